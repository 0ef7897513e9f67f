# GPT-2 small's shape (124M parameters) on a corpus of your own, on 8 GPUs:
#   python prepare.py /path/to/corpus --out_dir=data/corpus        # GPT-2 tokens
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
# ~0.5M tokens per update: 16 sequences x 1024 tokens x 32 micro-steps, shared by all GPUs.
out_dir = "out-gpt2"
data_dir = "data/corpus"
eval_interval = 1000
eval_iters = 100
log_interval = 10

batch_size = 16
block_size = 1024
gradient_accumulation_steps = 32

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0

learning_rate = 6e-4
max_iters = 20000
lr_decay_iters = 20000
min_lr = 6e-5
warmup_iters = 700
compile = True

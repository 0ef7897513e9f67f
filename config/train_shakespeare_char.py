# The classic: a character-level model of Shakespeare (nanoGPT's baby GPT, ~10M parameters).
#   python prepare.py input.txt --tokenizer=char --out_dir=data/shakespeare_char
#   python train.py config/train_shakespeare_char.py
# A few minutes on one GPU. On a laptop CPU, shrink it (about two minutes on 2 cores):
#   python train.py config/train_shakespeare_char.py --device=cpu --eval_iters=20 --log_interval=100 \
#       --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 \
#       --lr_decay_iters=2000 --dropout=0.0
out_dir = "out-shakespeare-char"
data_dir = "data/shakespeare_char"
eval_interval = 250  # it overfits: keep an eye on val loss
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # keep only checkpoints that improve val loss

gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # characters of context

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99  # few tokens per step
warmup_iters = 100

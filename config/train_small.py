# The default job: a ~2.4M-parameter model on the Python standard library's source, tokenized with
# a 4,096-token BPE. About 5 minutes on a 2-core CPU; seconds on a GPU.
#   python prepare.py --tokenizer=bpe:4096      # -> data/stdlib
#   python train.py config/train_small.py
#   python sample.py --out_dir=out-small --start="import "
out_dir = "out-small"
data_dir = "data/stdlib"
eval_interval = 250
eval_iters = 20
log_interval = 25

batch_size = 16
block_size = 128
n_layer = 4
n_head = 6
n_kv_head = 2  # grouped-query attention: 3 query heads share each key/value head
n_embd = 192
dropout = 0.0

learning_rate = 2e-3  # small models take a high rate
max_iters = 1000
lr_decay_iters = 1000
min_lr = 2e-4
warmup_iters = 50
beta2 = 0.99  # few tokens per step

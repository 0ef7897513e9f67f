# The default job: a ~2.4M-parameter model on the Python standard library's source, tokenized with
# a 4,096-token BPE. About 5 minutes on a 2-core CPU; seconds on a GPU.
#   python prepare.py --tokenizer=bpe:4096      # -> data/stdlib
#   python train.py config/train_small.py
#   python sample.py --out_dir=out-small --start="import "
out_dir = "out-small"
data_dir = "data/stdlib"
eval_interval = 500  # at the start, halfway and the end: each evaluation costs ~15 steps
eval_iters = 20
log_interval = 25

batch_size = 16
block_size = 128
n_layer = 4
n_head = 6
n_kv_head = 2  # grouped-query attention: 3 query heads share each key/value head
n_embd = 192
dropout = 0.0

# A short run learns most from a high rate held stable, then decayed to ~0 at the end (wsd, over the last
# 40% of the steps), rather than a cosine that starts decaying at once and stops at a tenth of the peak.
learning_rate = 2e-3  # small models take a high rate
lr_schedule = "wsd"
lr_decay_fraction = 0.4
max_iters = 1000
lr_decay_iters = 1000
min_lr = 1e-5
warmup_iters = 50
beta2 = 0.99  # few tokens per step

# nanoGPT's CPU "baby" run on Shakespeare's characters (4 layers, 4 heads, 128 wide, block 64, batch 12:
# validation loss 1.9069 over the whole val split after 2,000 iterations, the mean of five seeds) to a lower loss in
# a third of its time on a 2-core CPU: each of five seeds 1.8731-1.8918, 3.07x less wall time (BENCHMARKS.md,
# 2026-11-27; measured
# on nanoGPT's own prepared files: python bench.py config/train_shakespeare_char_cpu.py --mode=seeds
#   --nanogpt=DIR --data_dir=...):
#   python prepare.py input.txt --tokenizer=char --out_dir=data/shakespeare_char
#   python train.py config/train_shakespeare_char_cpu.py
# The baby's depth, block and batch, but 96 wide instead of 128 (3 heads of 32): a step costs ~2/3 of the
# baby's, and this model (rotary, SwiGLU, RMSNorm) learns more per step. A short warmup, a higher peak
# rate held stable and a linear decay to ~0 over the last 40% of the steps (lr_schedule='wsd') get
# there in 760 steps. Muon is not used: torch's orthogonalizes in bf16, made for GPUs; on a 2-core CPU a step
# of it took 24x AdamW's (BENCHMARKS.md, 2026-11-27).
out_dir = "out-shakespeare-char-cpu"
data_dir = "data/shakespeare_char"
device = "cpu"
compile = False  # compiling takes longer than the whole run

eval_interval = 760  # evaluate at the start and the end only: evaluation is time not spent training
eval_iters = 20  # as nanoGPT's run: 20 batches per split
log_interval = 100
always_save_checkpoint = False

batch_size = 12
block_size = 64
n_layer = 4
n_head = 3
n_embd = 96
dropout = 0.0

optimizer = "adamw"
learning_rate = 3e-3
beta2 = 0.99  # few tokens per step
lr_schedule = "wsd"
lr_decay_fraction = 0.4
warmup_iters = 20
max_iters = 760
lr_decay_iters = 760
min_lr = 1e-5

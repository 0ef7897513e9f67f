# Supervised fine-tuning of a released model on conversations, every weight trained (a full fine-tune): the
# recipe of config/sft_qwen3.py without LoRA. It holds the weights, their gradients and two Adam moments, about
# 16 bytes a parameter (~10 GB for Qwen3-0.6B; past one GPU add --fsdp=True), and needs a learning rate ~10x
# below LoRA's: 1e-5 to 2e-5, as TRL's and the model cards' full SFT recipes use. With a folder on disk:
#
#   python prepare.py chats.jsonl --tokenizer=models/Qwen3-0.6B --out_dir=data/sft     # messages or ShareGPT
#   python train.py config/sft_qwen3_full.py
#   python eval.py --out_dir=out-sft-full --ckpt=ckpt_best.pt      # each val conversation on its own, as logged
#   python export.py --out_dir=out-sft-full --ckpt=ckpt_best.pt --to=models/Qwen3-0.6B-sft

init_from = "models/Qwen3-0.6B"  # another model: --init_from=FOLDER, its shape read from its config.json
data_dir = "data/sft"  # prepared with the model's own tokenizer (train.py refuses any other)
out_dir = "out-sft-full"

sequences = "examples"  # whole conversations packed into block_size, an epoch visiting each once
max_epochs = 3  # TRL's num_train_epochs: the run ends after 3 passes (or at max_iters, if sooner)
block_size = 2048
batch_size = 4
gradient_accumulation_steps = 8  # 32 sequences of up to 2,048 tokens per update

lora_rank = 0  # every weight trains, in fp32 master weights under autocast

learning_rate = 2e-5
min_lr = 2e-6
warmup_ratio = 0.03  # of the run's steps
max_iters = 100_000  # max_epochs decides
lr_decay_iters = 100_000  # cut to the run's steps by max_epochs
weight_decay = 0.0  # no pull of the pretrained weights towards zero
grad_clip = 1.0
dropout = 0.0
eval_interval = 100  # the whole val split, each conversation on its own
eval_iters = 10  # the train loss from 10 micro-batches, forward only: under 1% of the 100 steps before it
early_stop_patience = 3  # a full fine-tune overfits sooner than LoRA: ckpt_best.pt keeps the best

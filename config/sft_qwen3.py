# Supervised fine-tuning of a released model on conversations, with LoRA: Qwen3-0.6B here, any Llama, Mistral,
# Qwen2 or Qwen3 folder the same way. The model reads whole conversations, rendered with the folder's own chat
# template, and learns only the assistant's turns (and the token that closes each); examples are packed whole
# and never attend to each other. With a folder on disk (nothing is fetched at run time):
#
#   python prepare.py chats.jsonl --tokenizer=models/Qwen3-0.6B --out_dir=data/sft     # {"messages": [...]} a line
#   python train.py config/sft_qwen3.py                           # add --lora_base_dtype=nf4 for QLoRA
#   python sample.py --out_dir=out-sft --chat --start="What is a monad?" --temperature=0
#   python export.py --out_dir=out-sft --ckpt=ckpt_best.pt --to=models/Qwen3-0.6B-sft   # template + eos kept

init_from = "models/Qwen3-0.6B"  # another model: --init_from=FOLDER, its shape read from its config.json
data_dir = "data/sft"  # prepared with the model's own tokenizer (train.py refuses any other)
out_dir = "out-sft"

sequences = "examples"  # whole conversations packed into block_size, an epoch visiting each once
max_epochs = 3  # TRL's num_train_epochs: the run ends after 3 passes (or at max_iters, if sooner)
block_size = 2048
batch_size = 4
gradient_accumulation_steps = 4  # 16 sequences of up to 2,048 tokens per update

lora_rank = 16
lora_alpha = 32.0
lora_dropout = 0.05
lora_base_dtype = "auto"  # 'nf4': the frozen base in 4 bits (QLoRA)

learning_rate = 2e-4
min_lr = 2e-5
warmup_ratio = 0.03  # of the run's steps
max_iters = 100_000  # max_epochs decides
lr_decay_iters = 100_000  # cut to the run's steps by max_epochs
weight_decay = 0.0
eval_interval = 100  # the whole val split, packed the same way
eval_iters = 10  # the train loss from 10 micro-batches, forward only: under 1% of the 100 steps before it
early_stop_patience = 5

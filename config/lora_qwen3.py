# LoRA (or QLoRA) fine-tuning of a released model: Qwen3-0.6B here, any Llama, Mistral, Qwen2 or Qwen3
# folder the same way, a 7B one on a single 24-80 GB GPU. The base stays frozen; only low-rank
# adapters train, so a checkpoint is megabytes. With a folder on disk (nothing is fetched at run time),
# e.g. from `huggingface-cli download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B`:
#
#   python prepare.py my_corpus/ --tokenizer=models/Qwen3-0.6B --out_dir=data/finetune
#   python train.py config/lora_qwen3.py                          # add --lora_base_dtype=nf4 for QLoRA
#   python sample.py --out_dir=out-lora --start="def fibonacci(n):" --temperature=0
#   python export.py --out_dir=out-lora --ckpt=ckpt_best.pt --to=models/Qwen3-0.6B-lora        # merged
#   python export.py --out_dir=out-lora --ckpt=ckpt_best.pt --to=adapters/qwen3 --adapter      # for peft
#
# then AutoModelForCausalLM.from_pretrained("models/Qwen3-0.6B-lora"), or
# PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("models/Qwen3-0.6B"), "adapters/qwen3").

init_from = "models/Qwen3-0.6B"  # another model: --init_from=FOLDER, its shape read from its config.json
data_dir = "data/finetune"  # prepared with the model's own tokenizer (train.py refuses any other)
out_dir = "out-lora"

lora_rank = 16
lora_alpha = 32.0  # the adapters' output is scaled by alpha / rank = 2
lora_dropout = 0.05
lora_targets = "q,k,v,o,gate,up,down"  # every projection: the most quality for the memory
lora_base_dtype = "auto"  # the frozen base in the run's dtype (bf16 on a GPU); 'nf4': 4 bits, QLoRA

block_size = 1024
compile = True  # LoRA's step compiled: 2.7x the eager one's tokens/s on an H200 (1 x 1024 tokens, BENCHMARKS.md),
# after ~90 s of compiling; --compile=False for a run of a few steps
batch_size = 4
gradient_accumulation_steps = 8  # 32 sequences of 1,024 tokens per update

# Adapters start at zero and take a higher rate than full fine-tuning; no weight decay on them.
learning_rate = 2e-4
min_lr = 2e-5
warmup_iters = 30
max_iters = 1000
lr_decay_iters = 1000
weight_decay = 0.0
eval_interval = 50
eval_iters = 20
early_stop_patience = 4  # ckpt_best.pt keeps the best; export that one

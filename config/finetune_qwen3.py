# Fine-tune a released model on your own text: Qwen3-0.6B here; any Llama, Mistral, Qwen2 or Qwen3
# folder works the same way. The folder is one you have on disk (nothing is fetched at run time),
# e.g. from `huggingface-cli download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B`. Then:
#
#   python sample.py --model=models/Qwen3-0.6B --start="def fibonacci(n):" --temperature=0   # before
#   python prepare.py my_corpus/ --tokenizer=models/Qwen3-0.6B --out_dir=data/finetune
#   python train.py config/finetune_qwen3.py
#   python sample.py --out_dir=out-finetune --start="def fibonacci(n):" --temperature=0     # after
#   python export.py --out_dir=out-finetune --ckpt=ckpt_best.pt --to=models/Qwen3-0.6B-finetuned
#
# and AutoModelForCausalLM.from_pretrained("models/Qwen3-0.6B-finetuned") in transformers (or vLLM).
# The shape comes from the folder's config.json; the settings below are the fine-tune's own.

init_from = "models/Qwen3-0.6B"  # another model: --init_from=FOLDER, its shape read from its config.json
data_dir = "data/finetune"  # prepared with the model's own tokenizer (train.py refuses any other)
out_dir = "out-finetune"

block_size = 1024  # the length trained on; at most the model's max_position_embeddings
compile = True  # the step compiled: 2.2x the eager one's tokens/s on an H200 (1 x 1024 tokens, BENCHMARKS.md),
# after ~75 s of compiling; --compile=False for a run of a few steps
batch_size = 4
gradient_accumulation_steps = 8  # 32 sequences of 1,024 tokens per update

# A pretrained model needs small steps: a learning rate ~30x below pretraining's, a short warmup, and
# no weight decay pulling its weights towards zero. Stop when validation loss stops improving.
learning_rate = 2e-5
min_lr = 2e-6
warmup_iters = 30
max_iters = 1000
lr_decay_iters = 1000
weight_decay = 0.0
dropout = 0.0
eval_interval = 50
eval_iters = 20
early_stop_patience = 4  # ckpt_best.pt keeps the best; export that one

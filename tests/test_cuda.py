"""The CUDA tier: what only a GPU can check, in one call of a few minutes on an H100 (`python -m pytest -m cuda
tests`). The fused kernels compiled for real against their references in bf16 and fp16 at the models' shapes,
FlexAttention's document mask against SDPA's, train.py in bf16 with compile, the kernels and doc_mask, FSDP on
one GPU, a resume from a mapped checkpoint, the memory estimate against the measured peak (tied head or not), LoRA
and QLoRA steps, a conversation run and sample.py --chat against the CPU's, a LoRA run's export in float32. Skipped
without a GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

import kernels as K
from lib.hf import load_pretrained, save_pretrained
from lib.lora import add_lora, quantize_base
from lib.memory import memory_estimate
from lib.optim import build_optimizers
from lib.settings import defaults
from model import GPT, GPTConfig, document_mask, rotary_tables
from test_kernels import fwd_bwd, rel_err
from helpers import ROOT, losses, run
from test_finetune import LORA, pretrained  # noqa: F401 (a fixture)
from test_sft import SMALL as CHAT, chat_data  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or K.INTERPRET or not K.HAS_TRITON,
    reason="needs a CUDA GPU, with Triton compiling (not TRITON_INTERPRET=1): the CUDA tier checks what only a "
           "GPU can")]

SHAPES = {  # n_embd, mlp_hidden, n_head, n_kv_head, head_size, vocab_size: those test_kernels.py compiles for
    "gpt2-124M": (768, 3072, 12, 12, 64, 50304),
    "qwen3-0.6B": (1024, 3072, 16, 8, 128, 151936),
    "llama-3.2-1B": (2048, 8192, 32, 8, 64, 128256),
    "llama-3.1-8B": (4096, 14336, 32, 8, 128, 128256),
}
HALF = [torch.bfloat16, torch.float16]
FLOOR = {torch.bfloat16: 2**-7, torch.float16: 2**-10}  # where eager's own error is nearly nothing
SMALL = ["--n_layer=2", "--n_head=4", "--n_embd=128", "--block_size=256", "--batch_size=8", "--eval_iters=4",
         "--log_interval=5", "--warmup_iters=5", "--learning_rate=3e-3", "--device=cuda"]


def cuda_randn(*shape, grad=True):
    return torch.randn(*shape, device="cuda").requires_grad_(grad)


def as_good_as_eager(op, ref, inputs, dtype):
    # op in dtype, forward and backward, against the reference in fp32 on the same values: no further off
    # than the reference itself run in dtype (what eager PyTorch gives), twice over, or FLOOR
    cast = [t.detach().to(dtype).requires_grad_() if t.requires_grad else t for t in inputs]
    upcast = [t.detach().float().requires_grad_() if t.requires_grad else t for t in cast]
    out, grads = fwd_bwd(op, cast)
    eager, eager_grads = fwd_bwd(ref, cast)
    truth, truth_grads = fwd_bwd(ref, upcast)
    assert out.dtype == eager.dtype
    for name, a, b, c in [("output", out, eager, truth), *[(f"gradient {i}", *g) for i, g in
                                                            enumerate(zip(grads, eager_grads, truth_grads))]]:
        assert a.dtype == b.dtype, name
        assert rel_err(a, c) <= 2 * rel_err(b, c) + FLOOR[dtype], (name, rel_err(a, c), rel_err(b, c))


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_kernels_against_references_at_the_models_shapes(shape, dtype):
    # every op the model calls, at the widths whose launch parameters kernels.launches() gives, 2,048 tokens
    n_embd, hidden, n_head, n_kv_head, head_size, vocab = shape
    assert len(K.launches(*shape)) == 9  # what these shapes launch: norms (two widths), swiglu, rotary, loss
    torch.manual_seed(0)
    B, T = 4, 512
    for C in (n_embd, head_size):  # the blocks' norms, and qk-norm's over each head
        weight = (1 + 0.1 * cuda_randn(C, grad=False)).requires_grad_()
        as_good_as_eager(lambda x, w: K.rms_norm(x, w, 1e-5), lambda x, w: K.rms_norm_ref(x, w, 1e-5),
                         [cuda_randn(B * T, C), weight], dtype)
    as_good_as_eager(K.swiglu, K.swiglu_ref, [cuda_randn(B * T, hidden), cuda_randn(B * T, hidden)], dtype)
    cos, sin = (t.cuda() for t in rotary_tables(head_size, T, 10000.0))  # fp32, as the model keeps them
    for heads in (n_head, n_kv_head):
        x = cuda_randn(B, T, heads, head_size)
        as_good_as_eager(K.apply_rotary, K.apply_rotary_ref, [x, cos, sin], dtype)
    N = 1024
    targets = torch.randint(0, vocab, (N,), device="cuda")
    targets[::7] = -1  # ignored, as padding and masked-out turns are
    head = (0.02 * cuda_randn(vocab, n_embd, grad=False)).requires_grad_()
    as_good_as_eager(K.linear_cross_entropy, K.linear_cross_entropy_ref, [cuda_randn(N, n_embd), head, targets],
                     dtype)


def test_flex_attention_doc_mask_matches_masked_sdpa():
    # doc_mask's CUDA path through the model's attention (grouped-query heads, bf16 autocast): its output and
    # gradients against SDPA with the boolean mask, each against the same in fp32
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=1024, n_layer=1, n_head=8, n_kv_head=2, n_embd=512)).cuda()
    attention = model.blocks[0].attn
    docs = torch.zeros(2, 1024, dtype=torch.long, device="cuda")
    docs[0, 300:], docs[0, 700:], docs[1, 517:] = 1, 2, 1  # boundaries inside 128-token blocks
    x, dy = torch.randn(2, 1024, 512, device="cuda"), torch.randn(2, 1024, 512, device="cuda")

    def run(mask, half):
        attention.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=half):
            y = attention(leaf, model.cos, model.sin, mask=mask)
        y.float().backward(dy)
        return [y.float(), leaf.grad, attention.q.weight.grad, attention.v.weight.grad]

    flex, sdpa = run(document_mask(docs, flex=True), True), run(document_mask(docs), True)
    truth = run(document_mask(docs), False)
    for name, a, b, c in zip(("output", "x grad", "q grad", "v grad"), flex, sdpa, truth):
        assert rel_err(a, c) <= 2 * rel_err(b, c) + 2**-7, (name, rel_err(a, c), rel_err(b, c))


def gpu_train(*args, env=None, script="train.py"):
    # a script on the GPU: the tests' CPU runs hide it (conftest.CPU_ENV), this one must see it
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        del env["CUDA_VISIBLE_DEVICES"]
    done = subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def records(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_bf16_run_with_compile_kernels_and_doc_mask(data_dir, tmp_path):
    # the block mask made outside the compiled model: no recompile across batches (TORCH_LOGS says each one)
    out = gpu_train(*SMALL, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--dtype=bfloat16",
                    "--compile=True", "--use_kernels=True", "--doc_mask=True", "--max_iters=40",
                    "--eval_interval=40", env={"TORCH_LOGS": "recompiles"})
    assert "on cuda, bfloat16" in out.stdout and "skipped" not in out.stdout
    assert "Recompiling" not in out.stderr, out.stderr[-3000:]
    evals = [r["val_loss"] for r in records(tmp_path) if "val_loss" in r]
    assert evals[-1] < evals[0] - 0.5
    steps = [r for r in records(tmp_path) if "mfu" in r]
    assert steps and all(r["mfu"] is None or 0 < r["mfu_run"] < r["mfu"] < 1 for r in steps)  # less run


@pytest.mark.parametrize("offload", [False, True], ids=["fsdp", "cpu_offload"])
def test_fsdp_bf16_on_one_gpu_trains_as_without_it(data_dir, tmp_path, offload):
    # and saves at its last step, just after an evaluation (which left the root unit's weights gathered on the GPU
    # beside the shards offloaded to the CPU: a traceback at the save), and resumes
    common = [*SMALL, f"--data_dir={data_dir}", "--dtype=bfloat16", "--max_iters=10", "--eval_interval=10",
              "--log_interval=1"]
    gpu_train(*common, f"--out_dir={tmp_path / 'plain'}")
    fsdp_args = [f"--out_dir={tmp_path / 'fsdp'}", "--fsdp=True", f"--fsdp_cpu_offload={offload}"]
    out = gpu_train(*common, *fsdp_args)
    assert "FSDP x1" in out.stdout and "saved" in out.stdout
    assert "resuming" in gpu_train(*common, *fsdp_args, "--max_iters=12", "--init_from=resume").stdout
    plain, fsdp = ({r["iter"]: r["loss"] for r in records(tmp_path / name) if "val_loss" not in r}
                   for name in ("plain", "fsdp"))
    assert plain.keys() == fsdp.keys() and len(plain) == 10
    assert all(abs(fsdp[i] - plain[i]) <= 2e-2 * plain[i] for i in plain), (plain, fsdp)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_memory_estimate_is_within_15_percent_of_the_peak(tied):
    # an eager bf16 step with AdamW (its state made by the first step, so the second is the peak) against
    # memory.py's estimate of the same step, the head the embedding's weight or one of its own
    torch.manual_seed(0)
    B, T = 8, 1024
    config = GPTConfig(vocab_size=32768, block_size=T, n_layer=8, n_head=16, n_kv_head=4, n_embd=1024,
                       tie_embeddings=tied)
    model = GPT(config).cuda()
    optimizers = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                                  "learning_rate": 1e-4, "weight_decay": 0.1}, "cuda")
    idx = torch.randint(0, 32768, (B, T), device="cuda")
    estimate = memory_estimate(model, B, T, "bfloat16", "adamw", device="cuda")["device"]
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    assert abs(peak - estimate) <= 0.15 * peak, (peak / 2**20, estimate / 2**20)


@pytest.mark.parametrize("base", ["bfloat16", "nf4"])
def test_lora_and_qlora_steps(base, tmp_path):
    # a folder's model with a bf16 base, or a 4-bit one (QLoRA), as train.py holds them: the adapters learn,
    # the base stays as it was
    if base == "nf4":
        pytest.importorskip("torchao", reason="QLoRA's 4-bit base needs torchao (pip install torchao)")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=8, n_kv_head=4, n_embd=512)
    save_pretrained(GPT(config), tmp_path / "base")
    model = add_lora(load_pretrained(str(tmp_path / "base"), torch.bfloat16), 8).cuda()
    if base == "nf4":
        quantize_base(model, "nf4")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if base != "nf4" and not p.requires_grad}
    # 1e-3: at 1e-2 these adapters diverge on a CPU too (6.27 to 7.98 in 8 steps, as on the H100)
    optimizers = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                                  "learning_rate": 1e-3, "weight_decay": 0.0}, "cuda")
    idx = torch.randint(0, 4096, (4, 256), device="cuda")
    losses = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(".lora." in n for n, p in model.named_parameters() if p.requires_grad)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    if base == "nf4":
        assert all(type(linear.weight).__name__ == "NF4Tensor" for _, _, linear in model.projections())


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_base_reaches_the_gpu_a_weight_at_a_time(kind, tmp_path):
    # train.py's order: the folder read with each projection quantized on the GPU as it comes (start.first_model),
    # adapters, then model.cuda(): the GPU's peak stays below the bf16 projections' bytes (a 13B base in bf16 is past
    # a 24 GB GPU; in nf4, ~7 GB), and the weights are those quantized on the GPU after the whole model went there
    pytest.importorskip("torchao", reason="quantized bases need torchao (pip install torchao)")
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=1024)
    save_pretrained(GPT(config), tmp_path / "base")
    model = add_lora(load_pretrained(str(tmp_path / "base"), torch.bfloat16), 8)
    projections = sum(linear.weight.numel() * 2 for _, _, linear in model.projections())
    whole = quantize_base(add_lora(load_pretrained(str(tmp_path / "base"), torch.bfloat16), 8).cuda(), kind)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = add_lora(load_pretrained(str(tmp_path / "base"), torch.bfloat16, quantized=kind, device="cuda"), 8).cuda()
    assert torch.cuda.max_memory_allocated() - before < 0.75 * projections, torch.cuda.max_memory_allocated() / 2**20
    x = torch.randint(0, 256, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # (the adapters' B starts at 0: the same model)
        assert torch.equal(model.eval()(x)[0], whole.eval()(x)[0])


# train.py run in this Python, which then says what it still maps of the out_dir's checkpoints (its globals alive)
KEEPING = ("import runpy, sys; sys.argv[0] = 'train.py'; kept = runpy.run_path('train.py', run_name='__main__'); "
           "print('MAPPED', [line for line in open('/proc/self/maps') if 'ckpt' in line])")


def test_a_resume_on_the_gpu_maps_its_checkpoint_and_ends_with_no_mapping_of_it(data_dir, tmp_path):
    # on a GPU a resume maps ckpt.pt (start.begin's mapped: a node's processes share one copy): the weights and
    # moments go to the GPU, and nothing of the run keeps the file mapped, or its disk blocks would stay held once
    # a save replaced it
    args = [*SMALL, f"--data_dir={data_dir}", "--eval_interval=2", "--log_interval=1"]
    gpu_train(*args, f"--out_dir={tmp_path / 'whole'}", "--max_iters=4")
    gpu_train(*args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=2")
    done = gpu_train(KEEPING, *args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=4", "--init_from=resume",
                     script="-c")
    assert "MAPPED []" in done.stdout, done.stdout[-2000:]
    whole, parts = losses(tmp_path / "whole"), losses(tmp_path / "parts")
    assert all(abs(parts[i] - whole[i]) <= 1e-5 * whole[i] for i in (3, 4)), (whole, parts)


def test_a_conversation_run_trains_as_on_the_cpu_and_its_chat_stops_at_the_end_of_turn(chat_data, tmp_path):
    # the masks of data format 2 (END after each example) and the loss over the trained tokens alone, with the
    # kernels compiled: the same losses as the CPU's fp32 run to tf32's error; sample.py --chat on the GPU gives the
    # CPU's reply to the same checkpoint, cut at the end-of-turn
    args = [*CHAT, f"--data_dir={chat_data}", "--n_embd=64", "--batch_size=8", "--warmup_iters=10", "--max_iters=300",
            "--lr_decay_iters=300", "--eval_interval=300", "--dtype=float32"]  # 300 steps: a reply, not at once its end
    run(*args, f"--out_dir={tmp_path / 'cpu'}")
    out = gpu_train(*args, f"--out_dir={tmp_path / 'gpu'}", "--device=cuda", "--use_kernels=True")
    assert "on cuda, float32" in out.stdout
    cpu, gpu = losses(tmp_path / "cpu"), losses(tmp_path / "gpu")
    assert cpu.keys() == gpu.keys() and len(cpu) == 300
    assert abs(gpu[1] - cpu[1]) <= 1e-3 * cpu[1], (cpu[1], gpu[1])
    assert all(abs(gpu[i] - cpu[i]) <= 2e-2 * cpu[i] for i in range(1, 31)), (cpu, gpu)
    chat = ["--chat", "--start=stone cloud seven", "--temperature=0", "--max_new_tokens=20", "--dtype=float32"]
    reply = gpu_train(f"--out_dir={tmp_path / 'cpu'}", *chat, "--device=cuda", script="sample.py").stdout
    assert reply == gpu_train(f"--out_dir={tmp_path / 'cpu'}", *chat, "--device=cpu", script="sample.py").stdout
    assert reply.strip() and "<|" not in reply  # the end-of-turn, <|user|>, never reached the text


def test_a_qlora_run_read_back_for_the_gpu_is_quantized_there(pretrained, tmp_path):
    # sample.py, eval.py and export.py read a QLoRA run's base quantized where they compute (trained.load_model's
    # device), a weight at a time, not on the CPU (to_nf4 there: hours at 70B); the same reply and export as on the CPU
    pytest.importorskip("torchao", reason="QLoRA's 4-bit base needs torchao (pip install torchao)")
    from lib.trained import load_model
    folder, data = pretrained
    gpu_train(*LORA, f"--data_dir={data}", f"--init_from={folder}", f"--out_dir={tmp_path}", "--max_iters=2",
              "--lora_base_dtype=nf4", "--device=cuda")
    model, _ = load_model(str(tmp_path / "ckpt.pt"), device="cuda")
    assert all(type(linear.weight).__name__ == "NF4Tensor" and linear.weight.device.type == "cuda"
               for _, _, linear in model.projections())
    said = [gpu_train(f"--out_dir={tmp_path}", "--start=the", "--temperature=0", "--max_new_tokens=8",
                      f"--device={device}", "--dtype=float32", script="sample.py").stdout for device in ("cuda", "cpu")]
    assert said[0].strip() and said[0] == said[1]
    # export.py merges it on the GPU too (its --device), into the same folder as on the CPU
    from safetensors.torch import load_file
    for device in ("cuda", "cpu"):
        gpu_train(f"--out_dir={tmp_path}", f"--to={tmp_path / device}", f"--device={device}", script="export.py")
    on_gpu, on_cpu = (load_file(tmp_path / device / "model.safetensors") for device in ("cuda", "cpu"))
    assert on_gpu.keys() == on_cpu.keys() and all(torch.equal(on_gpu[k], on_cpu[k]) for k in on_gpu)


def test_a_lora_run_on_the_gpu_exports_in_float32_with_its_adapters_whole(pretrained, tmp_path):
    # a float32 folder's LoRA run, its base held in the GPU's bf16 ('auto'): exported in the folder's float32 as
    # the held weight plus the adapters' change, not that sum rounded to bf16
    from safetensors.torch import load_file

    from lib.resume import load_checkpoint, model_from_checkpoint
    folder, data = pretrained
    out = gpu_train(*LORA, f"--data_dir={data}", f"--init_from={folder}", f"--out_dir={tmp_path / 'run'}",
                    "--max_iters=4", "--device=cuda")
    assert "on cuda, bfloat16" in out.stdout
    gpu_train(f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}", script="export.py")
    trained = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), torch.bfloat16)
    q = trained.blocks[0].attn.q
    exported = load_file(tmp_path / "hf" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert exported.dtype == torch.float32 and q.weight.dtype == torch.bfloat16 and q.lora.delta().abs().max() > 0
    torch.testing.assert_close(exported, q.weight.float() + q.lora.delta(), rtol=0, atol=1e-7)

"""The memory estimate (memory.memory_estimate): its weights, gradients and optimizer state against the bytes
of the real tensors after a step (one process, FSDP on two, LoRA), its activations (a trace of the model's
forward on fake tensors) against what autograd saves of a real forward, also of a model edited at run time,
its peak against MemTracker's, and bench.py --mode=memory."""

import contextlib
import json
import re
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from configurator import configure
from helpers import free_port, script
from lib import memory, micro_batch, optim
from lib.files import UserError
from lib.lora import add_lora, quantize_base
from lib.memory import memory_estimate, nf4_bytes, tensor_bytes
from model import GPT, GPTConfig
from lib.optim import build_optimizers
from lib.settings import defaults

SHAPE = dict(vocab_size=67, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, use_kernels=False)


def real_bytes(model, optimizers):
    # what one step left in memory: parameters, their gradients and every optimizer's state
    def size(t):
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this process's shard
        return tensor_bytes(t)
    params = list(model.parameters())
    return {"weights": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(t) for opt in optimizers for s in opt.state.values() for t in s.values())}


def one_step(model, kind):
    optimizers = build_optimizers(model, {**defaults(), "optimizer": kind,
                                  "learning_rate": 1e-3, "weight_decay": 0.1}, "cpu")
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    for opt in optimizers:
        opt.step()
    return real_bytes(model, optimizers)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "muon"])
def test_weights_grads_and_optimizer_state_are_the_real_tensors_bytes(kind):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    real = one_step(model, kind)
    estimate = memory_estimate(model, 2, 16, "float32", kind)
    assert {k: estimate[k] for k in real} == real


def test_a_bfloat16_models_gradients_and_state_are_its_own_dtypes_bytes():
    # a model fine-tuned in bf16 whole: its gradients are bf16 too, half of float32's
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE)).to(torch.bfloat16)
    real = one_step(model, "adamw")
    estimate = memory_estimate(model, 2, 16, "bfloat16", "adamw")
    assert {k: estimate[k] for k in real} == real


def test_fsdp_gathers_the_root_and_one_block_with_its_gradients_in_the_compute_dtype():
    # each process of FSDP holds, whole, the embedding and head all step and one block and its gradients at a time
    model = GPT(GPTConfig(**SHAPE))
    root = sum(p.numel() for n, p in model.named_parameters() if "blocks." not in n)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        assert memory_estimate(model, 2, 16, dtype, dp=2, fsdp=True)["copies"] == (root + 2 * block) * size


def test_offload_keeps_the_shards_weights_gradients_and_state_on_the_host():
    model = GPT(GPTConfig(**SHAPE))
    kept, offloaded = (memory_estimate(model, 2, 16, "bfloat16", dp=2, fsdp=True, offload=o) for o in (False, True))
    assert kept["host"] == 0 and offloaded["host"] == kept["weights"] + kept["grads"] + kept["optimizer"] > 0
    assert kept["device"] - offloaded["device"] >= kept["weights"] + kept["optimizer"]


def test_an_optimizer_memory_py_does_not_know_is_estimated_as_its_real_state(monkeypatch):
    # A new optimizer is a function in lib/optim.py alone: Adafactor keeps a factored second moment (a row and
    # a column for each matrix, shaped unlike it) and a step, which memory.py, naming no optimizer, counts as a
    # step of it leaves them (the third block's as the second's); SGD without momentum keeps nothing at all
    def adafactor(named, config, fused):
        return [torch.optim.Adafactor([p for _, p in named], lr=config["learning_rate"])]
    monkeypatch.setitem(optim.OPTIMIZERS, "adafactor_test", adafactor)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAPE, "n_layer": 3}))
    real = one_step(model, "adafactor_test")
    estimate = memory_estimate(model, 2, 16, "float32", "adafactor_test")
    assert estimate["optimizer"] == real["optimizer"]
    assert 0 < real["optimizer"] < memory_estimate(model, 2, 16, "float32", "adamw")["optimizer"] / 2
    no_momentum = {**defaults(), "optimizer": "sgd", "momentum": 0.0}  # the run's settings, not only a name
    assert memory_estimate(model, 2, 16, "float32", no_momentum)["optimizer"] == 0


def test_lora_counts_only_the_adapters_gradients_and_state():
    torch.manual_seed(0)
    model = add_lora(GPT(GPTConfig(**SHAPE)).to(torch.bfloat16), 4)  # a bf16 base, fp32 adapters
    real = one_step(model, "adamw")
    estimate = memory_estimate(model, 2, 16, "bfloat16", "adamw")
    assert {k: estimate[k] for k in real} == real
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert real["grads"] == 4 * adapters < real["weights"]


@pytest.mark.parametrize("lora", [0, 4])
def test_checkpoint_is_the_bytes_of_the_tensors_a_checkpoint_holds(lora):
    # what check_room weighs a checkpoint at: the weights it saves (a LoRA run's adapters alone, not its base) and the
    # optimizer's state, each tensor once (a tied weight is one), as train.py saves them after a step
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    if lora:
        add_lora(model, lora)
    optimizers = build_optimizers(model, {**defaults(), "learning_rate": 1e-3}, "cpu")
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    model(x, x)[1].backward()
    for opt in optimizers:
        opt.step()
    weights = {n: t for n, t in model.state_dict().items() if not lora or "lora" in n}
    tensors = [*weights.values(), *(t for opt in optimizers for s in opt.state_dict()["state"].values()
                                    for t in s.values())]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert memory_estimate(model, 2, 16, "float32", "adamw")["checkpoint"] == sum(held.values())


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_base_is_counted_at_its_size(kind):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = add_lora(GPT(GPTConfig(**{**SHAPE, "n_embd": 64})), 4)
    planned = memory_estimate(model, 2, 16, "float32", "adamw", quantized=kind)  # before quantizing: the shapes
    quantize_base(model, kind)
    real = one_step(model, "adamw")
    assert {k: planned[k] for k in real} == real
    assert memory_estimate(model, 2, 16, "float32", "adamw")["weights"] == planned["weights"]  # as it is now
    held = tensor_bytes(model.blocks[0].attn.proj.weight)
    assert held == (nf4_bytes(64 * 64) if kind == "nf4" else 64 * 64 + 5 * 64)  # int8, scale and zero point a row


def parallel_worker(rank, port, out):
    # one of 2 processes (torch.multiprocessing, gloo): the tiny model laid out as train.py lays it out, FSDP over 2
    # replicas, then tensor parallel over 2 (with FSDP over one replica), one step each; rank 0 writes the bytes
    from torch.distributed.device_mesh import init_device_mesh
    from lib.parallel import parallelize
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for name, layout in (("fsdp", dict(dp=2, fsdp=True)), ("tp", dict(tp=2, fsdp=True))):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SHAPE))
        mesh = init_device_mesh("cpu", (layout.get("dp", 1), layout.get("tp", 1)), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh, tp=layout.get("tp", 1), fsdp=True)
        real = one_step(model, "adamw")
        estimate = memory_estimate(model, 2, 16, "float32", "adamw", **layout)
        results[name] = {"real": real, "estimate": {k: estimate[k] for k in real}}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def on_two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel") / "bytes.json"
    torch.multiprocessing.spawn(parallel_worker, args=(free_port(), str(out)), nprocs=2)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_fsdp_and_tensor_parallel_on_two_processes_are_rank_0s_parts(layout, on_two_processes):
    # FSDP: vocab_size 67 is odd, so rank 0 holds 34 rows of the embedding (torch.chunk's split), rank 1 33.
    # TP: half of q, k, v, gate and up by rows, of attn.proj and mlp.down by columns, the rest whole
    result = on_two_processes[layout]
    assert result["real"] == result["estimate"]
    whole = memory_estimate(GPT(GPTConfig(**SHAPE)), 2, 16, "float32", "adamw")
    assert whole["weights"] / 2 < result["real"]["weights"] < whole["weights"]  # about half


def saved_bytes(model, batch_size, block_size, dtype):
    # what autograd keeps of one forward for the backward: the bytes of the distinct storages its saved
    # tensors live in, less the parameters' and buffers' own (those are the weights)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randint(0, model.config.vocab_size, (batch_size, block_size))
    autocast = contextlib.nullcontext() if dtype == "float32" else torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x, x)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape, batch_size, block_size", [
    (SHAPE, 2, 16),
    (dict(vocab_size=1024, block_size=64, n_layer=3, n_head=6, n_embd=96, tie_embeddings=False,
          use_kernels=False), 3, 64),
    (dict(SHAPE, head_size=16, qk_norm=True, qkv_bias=True), 2, 16),  # Qwen3's and Qwen2's extras
])
def test_activations_are_what_autograd_saves(shape, batch_size, block_size, dtype):
    # The trace runs the same forward on fake tensors and counts the same storages: the same bytes, to the
    # byte (the blocks are alike, so that two traced blocks scaled to three are exact). Under autocast the
    # bf16 copies of the weights are saved tensors too: the estimate's copies.
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape))
    real = saved_bytes(model, batch_size, block_size, dtype)
    estimate = memory_estimate(model, batch_size, block_size, dtype, device="cpu")
    assert estimate["activations"] + estimate["copies"] == real
    assert (estimate["copies"] > 0) == (dtype == "bfloat16")


# The quick tier keeps the case that takes every branch (Qwen3's heads, bf16's copies); the other three run the
# same code under Triton's interpreter (~5-10 s each) and are in the slow tier.
@pytest.mark.parametrize("shape, dtype", [
    pytest.param(SHAPE, "float32", marks=pytest.mark.slow),
    pytest.param(SHAPE, "bfloat16", marks=pytest.mark.slow),
    pytest.param(dict(SHAPE, head_size=16, qk_norm=True, qkv_bias=True), "float32", marks=pytest.mark.slow),
    (dict(SHAPE, head_size=16, qk_norm=True, qkv_bias=True), "bfloat16"),
])
def test_activations_with_the_fused_kernels_are_what_autograd_saves(shape, dtype):
    # the estimate's other branch: the Triton ops (under Triton's interpreter on a CPU) keep what their
    # backward needs, which is not what the plain ops keep
    import kernels
    if not kernels.triton_can_run(torch.zeros(1)):
        pytest.skip("Triton cannot run on this CPU (no triton, or TRITON_INTERPRET unset)")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**shape, "use_kernels": True}))
    real = saved_bytes(model, 2, 16, dtype)
    estimate = memory_estimate(model, 2, 16, dtype, device="cpu")  # (traced through the ops' fakes)
    assert estimate["activations"] + estimate["copies"] == real
    plain = memory_estimate(GPT(GPTConfig(**shape)), 2, 16, dtype, device="cpu")
    assert plain["activations"] != estimate["activations"]  # (else this test would check nothing new)


def peak_of_a_step(model, batch_size, block_size, dtype):
    # the most memory one training step holds at any moment (after a first step made the optimizer's state), as
    # torch's MemTracker counts the tensors alive; on fake tensors (shapes only), so the fused ops cost no time
    from torch.distributed._tools.mem_tracker import MemTracker
    optimizer = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                                 "learning_rate": 1e-3, "weight_decay": 0.1}, "cpu")[0]
    x = torch.randint(0, model.config.vocab_size, (batch_size, block_size))
    autocast = contextlib.nullcontext() if dtype == "float32" else torch.autocast("cpu", dtype=torch.bfloat16)

    def step():
        with autocast:
            _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return sum(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values())


# The quick tier keeps bf16 (the estimate's copies) with and without the fused ops; fp32 runs the same branches
# and is in the slow tier. A large vocabulary and one sequence: the peak comes past the blocks' backward (below).
@pytest.mark.parametrize("fused, dtype, vocab_size, batch_size, checkpointing", [
    pytest.param(False, "float32", 512, 4, False, marks=pytest.mark.slow), (False, "bfloat16", 512, 4, False),
    pytest.param(True, "float32", 512, 4, False, marks=pytest.mark.slow), (True, "bfloat16", 512, 4, False),
    (False, "float32", 8192, 1, False), (False, "bfloat16", 8192, 1, True)])
def test_device_is_the_peak_of_a_step(fused, dtype, vocab_size, batch_size, checkpointing, monkeypatch):
    # The estimate's device figure against the peak of a whole step, as torch's MemTracker counts the tensors
    # alive on fake tensors. Both count the same tensors but for what the estimate leaves out: the rotary
    # tables (buffers) and what an op allocates inside itself, which a fake cannot show to MemTracker (the
    # fused loss's chunk of logits, memory.workspace: left out here too). The fused ops' peak comes in the
    # last block's backward, the plain ones' at the loss; the optimizer's step stays below both. With a large
    # vocabulary it comes after the blocks' backward, checkpointing or not: the tied embedding's backward holds
    # the head's gradient of the shared weight, its own and their sum beside every block's gradients (3 x V x C,
    # 20% of the peak here). Fake CUDA tensors would check CUDA's choices too, but a CPU-only torch cannot run
    # autograd on them (its InputMetadata asks for a CUDA device guard).
    from torch._subclasses.fake_tensor import FakeTensorMode
    import kernels
    from lib.parallel import parallelize
    if fused and not kernels.triton_can_run(torch.zeros(1)):  # the fused ops would quietly be the references
        pytest.skip("Triton cannot run on this CPU (no triton, or TRITON_INTERPRET unset: a machine with a GPU)")
    with FakeTensorMode():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=128,
                              use_kernels=fused))
        parallelize(model, checkpointing=checkpointing)
        peak = peak_of_a_step(model, batch_size, 64, dtype)
    monkeypatch.setattr(memory, "workspace", lambda func, args: 0)
    estimate = memory_estimate(model, batch_size, 64, dtype, checkpointing=checkpointing, device="cpu")["device"]
    buffers = sum(tensor_bytes(b) for b in model.buffers())
    assert abs(peak - (estimate + buffers)) <= 16  # the loss, a 0-d tensor, counted by one of them only


class Alive(TorchDispatchMode):
    # the most bytes alive at once in the storages the ops under it make, each once, known ones never
    def __init__(self, known):
        super().__init__()
        self.known, self.made, self.alive, self.peak = known, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for storage in [t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]:
            key = storage._cdata
            if key not in self.made and key not in self.known:
                self.made[key] = (storage.nbytes(), weakref.ref(storage, partial(self.free, key)))
                self.alive += storage.nbytes()
        self.peak = max(self.peak, self.alive)
        return out

    def free(self, key, _):
        self.alive -= self.made.pop(key)[0]


@pytest.mark.parametrize("micro_steps, lora_rank", [(2, 0), (1, 8), (1, 0)])
def test_device_under_checkpointing_is_the_peak_of_micro_steps_or_above_it_by_little(micro_steps, lora_rank):
    # The peak of micro-steps' forwards and backwards on real tensors, beside the weights and the optimizer's state
    # a first step made. Checkpointing's peak comes while the backward recomputes a block: with every gradient
    # kept from the first micro-step it is at the last block, else at the first. The estimate counts the traced
    # block's backward's peak at both, where the real one comes at one moment of it: above by little, never below
    # (it was 7% below with two micro-steps, and 9% with LoRA's small gradients)
    from lib.parallel import parallelize
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=2, n_embd=64))
    if lora_rank:
        add_lora(model, lora_rank)
    estimate = memory_estimate(model, 4, 64, checkpointing=True, micro_steps=micro_steps, device="cpu")["device"]
    parallelize(model, checkpointing=True)
    optimizers = build_optimizers(model, {**defaults(), "optimizer": "adamw"}, "cpu")
    x = torch.randint(0, 65, (4, 64))
    model(x, x)[1].backward()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    held = [*model.parameters(), *[t for opt in optimizers for state in opt.state.values() for t in state.values()]]
    alive = Alive({t.untyped_storage()._cdata for t in [*held, *model.buffers()]})  # (the rotary tables: not counted)
    with alive:
        for _ in range(micro_steps):
            model(x, x)[1].backward()
    measured = alive.peak + sum(tensor_bytes(t) for t in held)
    assert measured <= estimate <= 1.03 * measured


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_activations_are_what_autograd_saves(dtype):
    torch.manual_seed(0)
    model = add_lora(GPT(GPTConfig(**SHAPE, qk_norm=True)).to(getattr(torch, dtype)), 4, targets="q,v,o,up,down")
    real = saved_bytes(model, 2, 16, dtype)
    estimate = memory_estimate(model, 2, 16, dtype, device="cpu")
    # exact: the trace keeps the first block apart, which under LoRA keeps less (its frozen input needs no
    # gradient, nor its k's rotation)
    assert estimate["activations"] + estimate["copies"] == real


def test_a_model_edited_at_run_time_is_estimated_as_it_runs(monkeypatch):
    # The point of measuring: an MLP that now keeps one more (B, T, C) tensor for its backward (tanh keeps its
    # output) changes the estimate by that tensor in each of the 3 blocks, with no edit of memory.py, and the
    # estimate is still what autograd saves
    import model as model_py
    shape = dict(SHAPE, n_layer=3)
    torch.manual_seed(0)
    before = memory_estimate(GPT(GPTConfig(**shape)), 2, 16, "float32", device="cpu")
    forward = model_py.MLP.forward
    monkeypatch.setattr(model_py.MLP, "forward", lambda mlp, x: forward(mlp, x) + 0.1 * torch.tanh(x))
    model = GPT(GPTConfig(**shape))
    after = memory_estimate(model, 2, 16, "float32", device="cpu")
    assert after["activations"] - before["activations"] == 3 * 2 * 16 * 32 * 4
    assert after["activations"] + after["copies"] == saved_bytes(model, 2, 16, "float32")


def test_a_cuda_plan_on_a_cpu_takes_cudas_choices():
    # The trace runs on fake CPU tensors, which answer x.is_cuda for the device planned for: there the model
    # (use_kernels=None) takes the fused kernels, and bf16 attention where a CPU computes it in fp32
    import kernels
    if not kernels.triton_can_run(torch.zeros(1)):
        pytest.skip("Triton cannot run on this CPU (no triton, or TRITON_INTERPRET unset: a GPU's machine)")
    model = GPT(GPTConfig(**{**SHAPE, "use_kernels": None}))
    fused = GPT(GPTConfig(**{**SHAPE, "use_kernels": True}))  # on a CPU under Triton's interpreter
    def activations(model, dtype, device):
        return memory_estimate(model, 2, 16, dtype, device=device)["activations"]
    # in fp32 on CUDA the keys and values are repeated for every query head (model.attention: SDPA's GQA would run
    # its math kernel), and SDPA keeps those: 2 more heads each, of 2 x 16 x 8 fp32 values, in each of 2 blocks
    repeated = 2 * 2 * (SHAPE["n_head"] - SHAPE["n_kv_head"]) * 2 * 16 * 8 * 4
    assert activations(model, "float32", "cuda") == activations(fused, "float32", "cpu") + repeated
    assert activations(model, "float32", "cuda") != activations(model, "float32", "cpu")
    # attention's inputs and output kept in bf16, not in fp32
    assert activations(fused, "bfloat16", "cuda") < activations(fused, "bfloat16", "cpu")


def test_a_7b_plan_is_traced_without_memory():
    # bench.py plans 7B models built on the meta device: a micro-batch of 8 x 4096 tokens keeps ~170 GiB of
    # activations, which the trace of two blocks on fake tensors never allocates (~0.1 s here)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096,
                              mlp_hidden=11008))
    estimate = memory_estimate(model, 8, 4096, "bfloat16", dp=8, fsdp=True, checkpointing=True)
    assert estimate["activations"] > 32 * 8 * 4096 * 4096 * 2  # each block's input, and one block's work


@pytest.mark.slow
def test_bench_memory_mode_plans_1_8_and_64_gpus():
    done = script("bench.py", "--mode=memory", "config/train_gpt2.py", "--batch_size=8")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [float(v.replace(",", "")) for v in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ") and "GPU" in line}
    assert {name.split(":")[0] for name in rows} == {"1 GPU", "8 GPUs", "64 GPUs"}
    single, fsdp = rows["1 GPU: 1 process"], rows["8 GPUs: FSDP x8"]
    assert 123e6 * 4 / 2**20 <= single[0] < 125e6 * 4 / 2**20  # GPT-2 small's 124M fp32 weights
    assert fsdp[0] == pytest.approx(single[0] / 8, rel=0.01)  # sharded eight ways
    assert rows["8 GPUs: FSDP x8 + checkpointing"][3] < fsdp[3] / 3  # activations recomputed


def test_train_prints_the_estimate_before_the_first_step(data_dir, tmp_path):
    done = script("train.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--n_layer=2", "--n_head=4",
                  "--n_embd=32", "--block_size=32", "--batch_size=4", "--max_iters=1", "--eval_iters=1",
                  "--log_interval=1", "--device=cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    table = lines.index("| MiB per process | weights | grads | optimizer | activations | copies | temporary "
                        "| device | host |")
    shape = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=64)  # 62 characters, padded
    weights = sum(p.numel() for p in GPT(shape).parameters()) * 4
    assert lines[table + 2].startswith(f"| 1 process | {weights / 2**20:.2f} | {weights / 2**20:.2f} |")
    assert table < min(i for i, line in enumerate(lines) if line.startswith("iter 1:"))


# -----------------------------------------------------------------------------
# batch_size='auto': the largest micro-batch that fits a budget, the update's sequences kept


def accumulated_peak(model, batch_size, block_size, micro_steps):
    # the most memory an update of micro_steps micro-batches holds at any moment: in its last micro-step, after a
    # first update made the optimizer's state, as MemTracker counts the tensors alive, on fake tensors
    from torch.distributed._tools.mem_tracker import MemTracker
    optimizer = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                                 "learning_rate": 1e-3, "weight_decay": 0.1}, "cpu")[0]
    x = torch.randint(0, model.config.vocab_size, (batch_size, block_size))

    def last_micro_step():
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    last_micro_step()
    if micro_steps > 1:  # the gradients the earlier micro-steps leave (MemTracker follows one pass only)
        model(x, x)[1].backward()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        last_micro_step()
    return sum(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.slow  # the quick tier's check of batch_size='auto': test_train.py's run with it
def test_auto_micro_batch_is_the_largest_whose_peak_fits_the_budget(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(micro_batch, "resident_bytes", lambda: 0)  # its own memory left out: a fixed figure
    fake = FakeTensorMode()
    with fake:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=128,
                              use_kernels=False))
    layout = dict(dp=1, tp=1, fsdp=False, checkpointing=False, offload=False)
    settings = dict(dtype="float32", optimizer="adamw", quantized=None, device="cpu")
    sizes = [1, 2, 4, 8, 16, 32]  # the divisors of the update's 32 sequences
    chosen = []
    for gib in (0.012, 0.025, 0.05):
        with fake:  # (its first try, a micro-step, on fake tensors too)
            b, note = micro_batch.auto_micro_batch(model, 32, 64, gib, layout, None, contextlib.nullcontext(),
                                                   **settings)
        assert note.startswith(f"batch_size='auto': micro-batch {b} of 32 sequences a process, estimated peak ")
        assert note.endswith(f" of {gib:.2f} GiB (memory_budget)\nmicro-batch {b} x {32 // b} accumulation x 1 "
                             f"processes x 64 tokens = 2,048 tokens per update")
        room = 0.9 * gib * 2**30  # less the 10% margin
        with fake:  # measured: this micro-batch's update fits, the next size up's does not
            assert accumulated_peak(model, b, 64, 32 // b) <= room
            bigger = sizes[sizes.index(b) + 1]
            assert accumulated_peak(model, bigger, 64, 32 // bigger) > room
        chosen.append(b)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]  # a larger budget, a larger micro-batch
    with pytest.raises(UserError, match=r"^batch_size='auto': one sequence needs .* GiB short; raise memory_budget "
                                        r"if it is set, turn on gradient_checkpointing"):
        micro_batch.auto_micro_batch(model, 32, 64, 0.001, layout, None, None, **settings)
    # a resumed run keeps its micro-batch on the same device, budget and processes; on another, chooses again
    before = {"config": {"batch_size_auto": True, "batch_size": 2, "memory_budget": 0.05}, "world_size": 1,
              "memory_device": memory.device_name("cpu")}
    assert micro_batch.auto_micro_batch(model, 32, 64, 0.05, layout, before, None, **settings)[0] == 2
    with fake:
        again = micro_batch.auto_micro_batch(model, 32, 64, 0.05, layout, {**before, "memory_device": "another"},
                                        contextlib.nullcontext(), **settings)
    assert again[0] == chosen[-1]


def kept_or_chosen_worker(rank, port, out):
    # one of 2 processes resuming a batch_size='auto' run begun on rank 0's GPU, rank 1's another: each compared its
    # own device with the checkpoint's, rank 0 kept the micro-batch and rank 1 chose anew in smallest()'s all-reduce,
    # which rank 0 never joined (a hang, or another collective matched)
    from datetime import timedelta
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=20))
    micro_batch.device_name = lambda device: f"the GPU of rank {rank}"  # (this process's module)
    micro_batch.fit_micro_batch = lambda peak, sequences, dp, budget, held=0: (4, 2**20)
    before = {"config": {"batch_size_auto": True, "batch_size": 2, "memory_budget": 1.0,
                         "gradient_accumulation_steps": 8}, "world_size": 2, "memory_device": "the GPU of rank 0"}
    layout = dict(dp=2, tp=1, fsdp=True, checkpointing=False, offload=False)
    try:
        b = micro_batch.auto_micro_batch(GPT(GPTConfig(**SHAPE)), 16, 16, 1.0, layout, before, None, dtype="float32",
                                         optimizer="adamw", quantized=None, device="cpu")[0]
    except Exception as e:  # (the old code's: a gloo timeout)
        b = type(e).__name__
    Path(f"{out}.{rank}").write_text(str(b))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_resume_keeps_its_micro_batch_in_every_process_or_in_none(tmp_path):
    torch.multiprocessing.spawn(kept_or_chosen_worker, args=(free_port(), str(tmp_path / "b")), nprocs=2)
    assert [(tmp_path / f"b.{rank}").read_text() for rank in (0, 1)] == ["4", "4"]  # chosen anew by both


def test_a_micro_batch_out_of_memory_in_a_try_is_halved_until_one_fits():
    class OutOfMemoryPast(torch.nn.Module):  # a model that runs out of memory past `fits` sequences
        def __init__(self, fits):
            super().__init__()
            self.fits, self.w = fits, torch.nn.Parameter(torch.ones(()))

        def forward(self, x, y):
            if len(x) > self.fits:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return None, torch.nn.functional.dropout(self.w * x.float(), 0.5).sum()
    state = torch.get_rng_state()
    assert micro_batch.tried_micro_batch(OutOfMemoryPast(12), 12, 48, 8, "cpu", contextlib.nullcontext()) == (12, None)
    assert torch.equal(torch.get_rng_state(), state)  # dropout's stream as if nothing had run
    model = OutOfMemoryPast(5)
    b, note = micro_batch.tried_micro_batch(model, 12, 48, 8, "cpu", contextlib.nullcontext())
    # 6 is tried too (it ran out of memory at the first step, in a traceback): 3 fits
    assert (b, note) == (3, "batch_size='auto': micro-batch 12 ran out of memory in a try: halved to 3, which fit")
    assert model.w.grad is None and torch.equal(torch.get_rng_state(), state)
    assert micro_batch.tried_micro_batch(model, 9, 27, 8, "cpu", contextlib.nullcontext())[0] == 3  # divides 27
    with pytest.raises(UserError, match="one sequence ran out of memory"):
        micro_batch.tried_micro_batch(OutOfMemoryPast(0), 1, 4, 8, "cpu", contextlib.nullcontext())

    class CpuOutOfMemory(OutOfMemoryPast):  # a CPU's allocator fails in a plain RuntimeError; another error stays one
        def forward(self, x, y):
            if len(x) > self.fits:
                raise RuntimeError(self.error)
            return super().forward(x, y)
    model = CpuOutOfMemory(5)
    model.error = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried"
    assert micro_batch.tried_micro_batch(model, 12, 48, 8, "cpu", contextlib.nullcontext())[0] == 3
    model.error = "mat1 and mat2 shapes cannot be multiplied"
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        micro_batch.tried_micro_batch(model, 12, 48, 8, "cpu", contextlib.nullcontext())


def test_batch_size_auto_keeps_the_number_it_replaces(tmp_path):
    config = {"batch_size": 12, "batch_size_auto": False, "gradient_accumulation_steps": 1}
    (tmp_path / "c.py").write_text("batch_size = 16\ngradient_accumulation_steps = 4\n")
    configure(config, [str(tmp_path / "c.py"), "--batch_size=auto"])
    assert config == {"batch_size": 16, "batch_size_auto": True, "gradient_accumulation_steps": 4}
    configure(config, ["--batch_size=8"])  # a number after it: a micro-batch of that number again
    assert config["batch_size"] == 8 and not config["batch_size_auto"]
    (tmp_path / "auto.py").write_text("batch_size = 'auto'\n")
    configure(config, [str(tmp_path / "auto.py")])
    assert config["batch_size"] == 8 and config["batch_size_auto"]
    # a config file's batch_size = 8 turns it off too: the number it was (Python keeps one object of each small
    # int) is the file's own assignment all the same
    (tmp_path / "eight.py").write_text("batch_size = 8\n")
    configure(config, [str(tmp_path / "eight.py")])
    assert config["batch_size"] == 8 and not config["batch_size_auto"]
    (tmp_path / "global.py").write_text("def _same():\n    global batch_size\n    batch_size = 8\n_same()\n")
    configure(config, ["--batch_size=auto", str(tmp_path / "global.py")])  # set through `global`: the same
    assert config["batch_size"] == 8 and not config["batch_size_auto"]


def test_batch_size_auto_shares_an_update_over_replicas_or_names_what_fits():
    # an update of 12 sequences over 2 replicas is 6 each, whatever gradient_accumulation_steps said; 13 are not
    # shared evenly; where the process itself holds most of the budget, the line says so and names memory_budget
    assert micro_batch.fit_micro_batch(lambda b: b, 12, 2, 100) == (6, 6)
    assert micro_batch.fit_micro_batch(lambda b: 16 * b, 12, 2, 100) == (3, 48)  # 96 is past 100 less its 10%
    layout = dict(dp=2, tp=1, fsdp=False, checkpointing=False, offload=False)
    resumed = {"config": {"batch_size_auto": True, "batch_size": 2}, "world_size": 2, "memory_device": "cpu"}
    for before in (None, resumed):  # chosen anew, or the micro-batch a resumed run began with
        with pytest.raises(UserError, match="the 13 sequences of an update .* multiple of the 2 data-parallel"):
            micro_batch.auto_micro_batch(None, 13, 64, 0.0, layout, before, None, device="cpu")
    with pytest.raises(UserError, match=r"needs 1.00 GiB \(0.20 GiB of it held already.*raise memory_budget"):
        micro_batch.fit_micro_batch(lambda b: 2**30, 4, 1, 2**29, held=0.2 * 2**30)
    # held already beyond what may be used: a larger budget is the one way out, and the line says only that
    with pytest.raises(UserError, match=r"^batch_size='auto': this process holds 922 MiB already \(Python, torch, "
                                        r"the data\), and 461 MiB may be used \(90% of 512 MiB\): raise "
                                        r"memory_budget, or leave it 0 for what the machine has$"):
        micro_batch.fit_micro_batch(lambda b: 2**30, 4, 1, 2**29, held=0.9 * 2**30)
    with pytest.raises(UserError, match=r"^batch_size='auto': this process holds 486 MiB already"):  # (past 461 MiB)
        micro_batch.fit_micro_batch(lambda b: 2**30, 4, 1, 2**29, held=0.95 * 2**29)


def test_a_micro_batch_chosen_anew_on_resume_and_a_budget_past_the_machine_are_said():
    # a resumed run whose budget changed chooses anew, and says what it began with; a budget past what the process
    # may have here is said beside the estimate (a CPU's process would meet the kernel's OOM killer, not an error)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    layout = dict(dp=1, tp=1, fsdp=False, checkpointing=False, offload=False)
    resumed = {"config": {"batch_size_auto": True, "batch_size": 2, "memory_budget": 2.0}, "world_size": 1,
               "memory_device": micro_batch.device_name("cpu")}
    kwargs = dict(dtype="float32", optimizer="adamw", quantized=None, device="cpu")
    b, note = micro_batch.auto_micro_batch(model, 8, 16, 4.0, layout, resumed, contextlib.nullcontext(), **kwargs)
    assert b == 8 and f"\nbatch_size='auto': chosen anew: the run began with micro-batch 2 on " \
        f"{micro_batch.device_name('cpu')}, memory_budget=2.0, 1 process(es)\n" in note, note
    assert "more than the" not in note
    note = micro_batch.auto_micro_batch(model, 8, 16, 1e9, layout, None, contextlib.nullcontext(), **kwargs)[1]
    assert re.search(r"of 1,?000,?000,?000.00 GiB \(memory_budget\), more than the [0-9.]+ GiB this process may "
                     r"have here \(cpu, [0-9.]+ GiB\)\n", note), note


def test_a_process_that_cannot_fit_one_sequence_says_so_after_the_others_heard(monkeypatch):
    # every process meets at smallest() before any stops: one that raised alone would leave the others waiting
    # there until dist_timeout. Here the one process's refusal comes after it took part
    heard = []
    monkeypatch.setattr(micro_batch, "smallest", lambda value, device: heard.append(value) or value)
    monkeypatch.setattr(micro_batch, "resident_bytes", lambda: 0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    layout = dict(dp=1, tp=1, fsdp=False, checkpointing=False, offload=False)
    with pytest.raises(UserError, match="^batch_size='auto': one sequence needs "):
        micro_batch.auto_micro_batch(model, 4, 16, 1e-6, layout, None, None, dtype="float32", optimizer="adamw",
                                     quantized=None, device="cpu")
    assert heard == [0, 0]  # whether every process keeps a checkpoint's micro-batch (no), then the micro-batch


def test_a_resumed_run_on_a_cpu_counts_its_restored_optimizer_state_once(monkeypatch):
    # on a CPU what the process holds beside the estimate's weights counts too; a resumed run holds its optimizer's
    # state already, which the estimate counts: chosen again (another budget), the same peak as a fresh run's
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    layout = dict(dp=1, tp=1, fsdp=False, checkpointing=False, offload=False)
    settings = dict(dtype="float32", optimizer="adamw", quantized=None, device="cpu")
    one = memory_estimate(model, 1, 16, **settings)
    before = {"config": {"batch_size_auto": True, "batch_size": 2, "memory_budget": 1.0}, "world_size": 1}
    held, fit = [], micro_batch.fit_micro_batch
    monkeypatch.setattr(micro_batch, "fit_micro_batch", lambda *a, **kw: held.append(kw["held"]) or fit(*a, **kw))
    for resident, resumed in ((one["weights"] + 1000, None), (one["weights"] + one["optimizer"] + 1000, before)):
        monkeypatch.setattr(micro_batch, "resident_bytes", lambda: resident)
        micro_batch.auto_micro_batch(model, 4, 16, 2.0, layout, resumed, contextlib.nullcontext(), **settings)
    assert held == [1000, 1000]  # beside what the estimate counts


def test_a_cpus_memory_is_shared_by_the_nodes_processes(monkeypatch):
    # torchrun's LOCAL_WORLD_SIZE processes on one machine each plan with their share of what it has available
    monkeypatch.setattr(micro_batch, "proc_kib", lambda field, path=None: 4_000_000)  # MemAvailable, KiB
    monkeypatch.setattr(micro_batch, "resident_bytes", lambda: 10**8)

    def no_cgroup(*args, **kwargs):
        raise OSError("no cgroup here")
    monkeypatch.setattr(micro_batch, "open", no_cgroup, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert micro_batch.available_memory("cpu") == 4_000_000 * 1024 + 10**8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert micro_batch.available_memory("cpu") == 1_000_000 * 1024 + 10**8  # its own resident memory its own


def test_the_memory_a_cuda_process_may_hold_counts_what_its_allocator_holds(monkeypatch):
    # free memory leaves out what this process's allocator reserved already: the weights on the GPU among it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 2 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 10**8)
    assert micro_batch.available_memory("cuda") == 13 * 10**8


def test_a_cpu_processs_measured_peak_is_its_high_water_mark(monkeypatch):
    monkeypatch.setattr(memory, "proc_kib", lambda field, path=None: {"VmHWM": 2048}[field])
    assert memory.measured_mb("cpu") == 2.0


def test_a_resume_whose_micro_batch_does_not_divide_its_share_chooses_anew():
    # a kept micro-batch of 3 for 8 sequences would leave 2 out of every update: one dividing 8 is chosen
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    layout = dict(dp=1, tp=1, fsdp=False, checkpointing=False, offload=False)
    resumed = {"config": {"batch_size_auto": True, "batch_size": 3, "memory_budget": 4.0}, "world_size": 1,
               "memory_device": micro_batch.device_name("cpu")}
    b, note = micro_batch.auto_micro_batch(model, 8, 16, 4.0, layout, resumed, contextlib.nullcontext(),
                                           dtype="float32", optimizer="adamw", quantized=None, device="cpu")
    assert b == 8 and "chosen anew: the run began with micro-batch 3" in note, note


def test_an_int8_base_keeps_its_dequantized_weights_for_the_backward():
    # torchao's int8 linear dequantizes its weight at each use and autograd keeps that fp32 copy for the input's
    # gradient (nf4's own op keeps the nf4 weight): planned before quantizing and estimated after, what is saved
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = add_lora(GPT(GPTConfig(**{**SHAPE, "n_layer": 3, "n_embd": 64})), 4)
    planned = memory_estimate(model, 2, 16, "float32", "adamw", quantized="int8", device="cpu")
    quantize_base(model, "int8")
    weights = {part.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]
               for part in ([getattr(p, n) for n in p.__tensor_flatten__()[0]]
                            if hasattr(p, "__tensor_flatten__") and type(p) is not torch.nn.Parameter else [p])}
    kept = {}

    def pack(t):
        if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    estimate = memory_estimate(model, 2, 16, "float32", "adamw", device="cpu")
    assert planned["activations"] + planned["copies"] == sum(kept.values())
    assert estimate["activations"] + estimate["copies"] == sum(kept.values())


def test_check_room_counts_the_epoch_copies_a_run_keeps(tmp_path, monkeypatch):
    # ckpt_epoch_N are never replaced: their bytes are no room for the next save, and each epoch adds one
    import shutil
    from collections import namedtuple
    from lib import checkpoint
    size = 2**20
    for name in ("ckpt.pt", "ckpt_best.pt", "ckpt_epoch_1.pt", "ckpt_epoch_2.pt"):
        (tmp_path / name).write_bytes(b"0" * size)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * size, 0, int(1.5 * size)))
    # the next save holds ckpt, ckpt.tmp, ckpt_best and its new copy: 2 new files in 1.5 checkpoints' room
    assert "will not all fit" in (checkpoint.check_room(str(tmp_path), size) or "")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * size, 0, 3 * size))
    assert checkpoint.check_room(str(tmp_path), size) is None  # room for those
    assert "3 epoch copies" in (checkpoint.check_room(str(tmp_path), size, epoch_copies=3) or "")


def test_ddp_keeps_its_gradients_twice_and_checkpointing_one_blocks_weight_copies():
    # DDP's flat buckets beside the gradients; under checkpointing autocast's copies of a block's weights are made
    # again as each block is recomputed, so one block's are held, not every block's
    model = GPT(GPTConfig(**SHAPE))
    one, ddp = (memory_estimate(model, 2, 16, "float32", dp=dp) for dp in (1, 2))
    assert ddp["grads"] == 2 * one["grads"] > 0
    assert ddp["device"] - one["device"] == one["grads"]  # its buckets, kept at the loss from the step before
    kept, recomputed = (memory_estimate(model, 2, 16, "bfloat16", checkpointing=c) for c in (False, True))
    block_copies = memory.traced_forward(model, 2, 16, "bfloat16").block_copies
    assert kept["copies"] - recomputed["copies"] == (model.config.n_layer - 1) * block_copies > 0

"""Tensor parallel and gradient checkpointing in train.py, on CPU processes (gloo), with tiny models."""

import re

import pytest
import torch

from helpers import STANDARD, TINY, losses, run, standard_run, train_refusal

from lib.checkpoint import find_checkpoint
from lib.resume import load_checkpoint
from lib.files import UserError, read_meta
from lib.hf import save_pretrained
from lib.settings import defaults
from lib.parallel import clip_gradients, parallelize
from lib.start import begin
from model import GPT, GPTConfig

pytestmark = pytest.mark.slow  # torchrun, mostly
TWO = ["--standalone", "--nproc_per_node=2"]


def assert_losses_close(a, b, rel=1e-5):
    assert a.keys() == b.keys() and a
    for step in a:
        assert abs(a[step] - b[step]) <= rel * abs(a[step]), (step, a[step], b[step])


def test_tensor_parallel_gives_the_losses_of_one_process(data_dir, tmp_path, shared):
    # 2 processes splitting every block (tp 2): the same tokens per update, the same losses (no dropout: its masks
    # are drawn per process) as the standard run in one process (helpers.standard_run, made once), over the first
    # 4 of its steps, which are run here without its evaluations (they change nothing in training). 4 processes as
    # 2 replicas of 2, with gradient checkpointing: test_scale's resume of FSDP's shards into that layout.
    one = {i: loss for i, loss in losses(standard_run(shared, data_dir, "one")).items() if i <= 4}
    common = [*STANDARD, f"--data_dir={data_dir}", "--max_iters=4", "--eval_interval=100"]
    out = run(*common, f"--out_dir={tmp_path / 'tp'}", "--tp_size=2", torchrun=TWO)
    assert "2 process(es) on cpu" in out.stdout
    assert "| FSDP x1 + TP x2 |" in out.stdout  # every parameter on the one mesh: FSDP over the single replica
    assert "sequential all_reduce" not in out.stderr, out.stderr  # (the gradients' norm: torch's warning per rank)
    assert_losses_close(one, losses(tmp_path / "tp"))


def test_compiled_tensor_parallel_blocks_share_one_graph(data_dir, tmp_path):
    # tp 2, compiled: each block compiled, one graph for all of them in training and one in evaluation (a recompile
    # for the grad mode alone). mesh["tp"] taken a block at a time gave the first block a mesh object of its own,
    # on which its graph is guarded: a second graph in each mode, compiled for that block alone.
    args = [*TINY, f"--data_dir={data_dir}", "--n_layer=3", "--max_iters=2", "--eval_interval=2",
            "--gradient_accumulation_steps=2", "--compile=True", f"--out_dir={tmp_path / 'tp'}", "--tp_size=2"]
    out = run(*args, torchrun=TWO, env={"TORCH_LOGS": "recompiles"})
    rank0 = [line for line in out.stderr.splitlines() if line.startswith("[rank0]") and "Recompiling function" in line]
    assert len(rank0) == 1, out.stderr[-3000:]
    assert "recompile_limit" not in out.stderr and "cache_size_limit" not in out.stderr


# an edit of model.py (made by a config file, in every process): a learned gain on the heads' outputs, inside
# attention, where tensor parallel gives each process its own heads; and its name added to parallel.HEAD_WEIGHTS,
# as the refusal without it says
GAINED = """import torch as _torch
import model as _m
class _Gained(_m.Attention):  # (a class of its own: the module's name for it is put back after an in-process run)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.o_gain = _torch.nn.Parameter(_torch.ones(1))
        self.proj.register_forward_pre_hook(self._gained)

    def _gained(self, module, args):  # the heads' outputs this process holds: their width said once
        if not hasattr(self, "_said"):
            self._said = print(f"heads' width here: {args[0].shape[-1]}", flush=True)
        return (args[0] * self.o_gain,)
_m.Attention = _Gained
"""
NAMED = "import lib.parallel as _p\n_p.HEAD_WEIGHTS += ('o_gain',)\n"


def test_tensor_parallel_sums_the_gradients_of_weights_every_head_shares(data_dir, tmp_path):
    # qk_norm's weights act on each process's own heads, so each process holds part of their gradient: summed over
    # the replica's processes, they train as in one process (one copy, not one per process, each on its heads); so
    # does a weight an edit of model.py adds inside attention, once named in HEAD_WEIGHTS: unnamed it is refused
    # (acting on a process's heads its gradient would be one process's part; on the whole stream, summed twice)
    (tmp_path / "gained.py").write_text(GAINED)
    (tmp_path / "named.py").write_text(NAMED)
    common = [*STANDARD, f"--data_dir={data_dir}", "--max_iters=4", "--eval_interval=4", "--qk_norm=True",
              str(tmp_path / "gained.py")]
    common.append(str(tmp_path / "named.py"))  # (unnamed: test_tensor_parallel_refusals)
    one = run(*common, f"--out_dir={tmp_path / 'one'}").stdout
    tp = run(*common, f"--out_dir={tmp_path / 'tp'}", "--tp_size=2", torchrun=TWO).stdout
    # every block's width, each process's, and the memory plan's (its trace: a block of tp's share of the heads)
    widths = [set(re.findall(r"heads' width here: (\d+)", out)) for out in (one, tp)]
    assert widths == [{"32"}, {"16"}], widths  # each process holds half the heads: tensor parallel split them
    assert_losses_close(losses(tmp_path / "one"), losses(tmp_path / "tp"))
    one, tp = (load_checkpoint(find_checkpoint(str(tmp_path / d / "ckpt.pt")))["model"] for d in ("one", "tp"))
    shared = [name for name in one if name.endswith(("q_norm.weight", "k_norm.weight", "o_gain"))]
    assert len(shared) == 6 and all(torch.allclose(one[n], tp[n], rtol=0, atol=1e-5) for n in shared), \
        [(n, (one[n] - tp[n]).abs().max().item()) for n in shared]


# a config file counting the forwards of the blocks (an edit of model.py), said as the process exits
COUNTED = """import atexit as _atexit
import model as _m
_calls = []
class _Counted(_m.Block):
    def forward(self, *args, **kwargs):
        _calls.append(1)
        return super().forward(*args, **kwargs)
_m.Block = _Counted
_atexit.register(lambda: print(f"block forwards: {len(_calls)}", flush=True))
"""


def test_gradient_checkpointing_changes_no_loss(data_dir, tmp_path):
    # recomputed activations are the same activations: dropout's masks too (the RNG state is replayed); and they
    # are recomputed: each of the 2 blocks runs its forward again in each of the 5 steps' backward
    (tmp_path / "counted.py").write_text(COUNTED)
    common = [*TINY, f"--data_dir={data_dir}", "--max_iters=5", "--eval_interval=100", "--dropout=0.1",
              str(tmp_path / "counted.py")]
    kept = run(*common, f"--out_dir={tmp_path / 'kept'}").stdout
    recomputed = run(*common, f"--out_dir={tmp_path / 'recomputed'}", "--gradient_checkpointing=True").stdout
    kept, recomputed = (int(re.search(r"block forwards: (\d+)", out)[1]) for out in (kept, recomputed))
    assert recomputed - kept == 5 * 2, (kept, recomputed)
    assert_losses_close(losses(tmp_path / "kept"), losses(tmp_path / "recomputed"))


def test_clip_gradients_scales_them_to_the_norm_given_and_returns_the_norm_before():
    model = torch.nn.Linear(4, 3)
    model.weight.grad, model.bias.grad = torch.full((3, 4), 2.0), torch.full((3,), 2.0)  # norm 2 * sqrt(15)
    assert clip_gradients(model, 1.0).item() == pytest.approx(2 * 15 ** 0.5, rel=1e-6)
    grads = [model.weight.grad, model.bias.grad]
    assert torch.nn.utils.get_total_norm(grads).item() == pytest.approx(1.0, rel=1e-5)
    assert clip_gradients(model, 3.0).item() == pytest.approx(1.0, rel=1e-5)  # below it: left as they are
    assert torch.nn.utils.get_total_norm(grads).item() == pytest.approx(1.0, rel=1e-5)


def test_tensor_parallel_refusals(data_dir, tmp_path):
    common = [*TINY, f"--data_dir={data_dir}", "--max_iters=2"]
    out = run(*common, f"--out_dir={tmp_path / 'a'}", "--tp_size=2", check=False)
    assert out.returncode != 0 and "tp_size=2 must divide the 1 processes" in out.stderr
    # The rest in process. The heads are checked by parallelize before it lays anything out, so no process group
    # is needed to see it refuse; the optimizer's refusal comes with the settings' checks, before the group forms.
    with pytest.raises(UserError, match="tp_size=2 must divide n_head=4 and n_kv_head=1"):
        parallelize(GPT(GPTConfig(n_layer=1, n_head=4, n_kv_head=1, n_embd=32, vocab_size=64, block_size=32)), tp=2)
    with pytest.raises(UserError, match=r"tp_size=2 must divide mlp_hidden=37 \(the MLP is split by width\)"):
        parallelize(GPT(GPTConfig(n_layer=1, n_head=4, mlp_hidden=37, n_embd=32, vocab_size=64, block_size=32)), tp=2)
    scaled = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=32))
    scaled.blocks[0].attn.gain = torch.nn.Parameter(torch.tensor(1.0))  # an edit of model.py: a 0-dim weight
    gained = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=32))
    gained.blocks[0].attn.o_gain = torch.nn.Parameter(torch.ones(1))  # an edit of model.py inside attention (GAINED)
    with pytest.raises(UserError, match=r"cannot tell whether blocks.0.attn.o_gain acts on a process's own heads "
                                        r"\(then add its name to lib/parallel.py's HEAD_WEIGHTS"):
        parallelize(gained, tp=2)
    for layout in (dict(tp=2), dict(fsdp=True)):
        with pytest.raises(UserError, match="blocks.0.attn.gain is a 0-dim parameter, which FSDP and tensor parallel "
                                            r"cannot shard: give it the shape \(1,\) in model.py"):
            parallelize(scaled, **layout)
    assert "optimizer='muon' does not run under tensor parallel" in train_refusal(
        *common, f"--out_dir={tmp_path / 'm'}", "--tp_size=2", "--optimizer=muon")
    # LoRA's refusal comes after the process group forms (start.begin, which every process calls): called here
    # in process with the run's settings, as train.py's processes would call it (the first refusal above shows
    # train.py printing such a refusal in one line and exiting 1)
    folder = tmp_path / "folder"
    save_pretrained(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=32)), folder)
    config = {**defaults(), "data_dir": str(data_dir), "out_dir": str(tmp_path / "c"),
              "init_from": str(folder), "lora_rank": 2, "tp_size": 2}
    with pytest.raises(UserError, match="LoRA does not run under tensor parallel"):
        begin(config, 64, read_meta(str(data_dir)), fsdp=True, eval_sequences=8)


def test_rotary_tables_stay_fp32_in_a_block_under_fsdp_bf16():
    # FSDP's bf16 policy casts a unit's floating-point inputs to bf16 by default: the rotary tables passed to each
    # block would be rounded (DDP's autocast keeps them fp32), a loss gap between the two. A gloo group of one.
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lib.parallel import parallelize
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, use_kernels=False))
        seen = []
        model.blocks[1].attn.register_forward_pre_hook(lambda module, args: seen.append((args[1].dtype, args[2].dtype)))
        parallelize(model, mesh, fsdp=True, dtype=torch.bfloat16)
        idx = torch.randint(0, 64, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        assert seen == [(torch.float32, torch.float32)]
        assert model.blocks[1].attn.q.weight.grad.dtype == torch.float32  # the fp32 shards' gradients, as before
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dead", ["rank 1 never claimed", "rank 1 claimed"])
def test_a_new_group_never_takes_a_dead_groups_generation(dead):
    # In process, over one store that outlives its groups, as torchrun's does: a dead group opened generation 1
    # (its rank 1 died before it claimed its place there, or after), and the new group's rank 1 starts before
    # its rank 0, seeing generation 1 still. Both must meet in generation 2, or rank 1 would dial the dead rank 0.
    import threading
    import time

    import torch.distributed as dist

    from lib.parallel import generation
    # a TCPStore, as torchrun's is, and a client of it for rank 1 (a HashStore's wait holds the GIL)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    store.add("generation", 1)
    if dead == "rank 1 claimed":
        store.add("generation_1/claim_1", 1)
        store.set("generation_1/confirm_1", "1")
    found = {}
    rank1 = threading.Thread(target=lambda: found.update({1: generation(client, 1, 2, 10)}))
    rank1.start()
    time.sleep(0.3)  # rank 1 has seen generation 1 and waits
    found[0] = generation(store, 0, 2, 10)
    rank1.join()
    assert found == {0: 2, 1: 2}
    with pytest.raises(UserError, match=r"rank\(s\) \[1\] did not join rank 0 within dist_timeout=1 s"):
        generation(store, 0, 2, 1)  # rank 1 never comes: rank 0 names it


def test_float16_refusal_names_tensor_parallel_where_it_brought_fsdp():
    # a run that set tp_size alone is not told about an fsdp=True it never gave
    from lib.parallel import init_distributed
    with pytest.raises(UserError, match=r"^tp_size=2 \(which brings FSDP\) does not work with dtype='float16'"):
        init_distributed("cpu", "float16", "gloo", 2, False, False, 60)
    with pytest.raises(UserError, match=r"^fsdp=True does not work with dtype='float16'"):
        init_distributed("cpu", "float16", "gloo", 1, True, False, 60)


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl"])
def test_cpu_offload_with_a_backend_that_has_none_for_the_cpu_is_one_line(monkeypatch, backend):
    # offloaded shards' gradients are reduced on the CPU, which nccl's collectives refuse: on 2 GPUs the first step
    # was a traceback ("No backend type associated with device type cpu"); auto gives nccl and gloo beside it
    from lib import parallel
    monkeypatch.setattr(parallel, "pick_device", lambda device, dtype: ("cuda", "bfloat16"))  # (as on a GPU)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # (a CUDA device's settings)
    try:
        with pytest.raises(UserError, match=rf"^backend='{backend}' has none for the CPU, where fsdp_cpu_offload=True "
                                            rf"keeps the shards and their gradients: use backend='auto'"):
            parallel.init_distributed("cuda", "bfloat16", backend, 1, True, True, 60)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "one_process"])
@pytest.mark.parametrize("backend", ["bogus", "cpu:gloo,cuda:no-such-backend"])
def test_a_backend_this_torch_lacks_is_one_line_before_any_process_group(backend, fsdp):
    # fsdp=True makes a group even of one process: a name torch has no backend for was its traceback. One process
    # alone makes none, and a typo there was recorded with the run (and met only on the cluster)
    import re
    from lib.parallel import init_distributed
    with pytest.raises(UserError, match=rf"backend={re.escape(repr(backend))}: '.*' is no backend this torch has "
                                        rf"\(.*gloo.*\); use backend='auto'"):
        init_distributed("cpu", "float32", backend, 1, fsdp, False, 60)
    assert not torch.distributed.is_initialized()
    assert init_distributed("cpu", "float32", "nccl", 1, False, False, 60).backend == "nccl"  # (a GPU's, named)
    assert init_distributed("cpu", "float32", "GLOO", 1, False, False, 60).backend == "GLOO"  # (torch's: any case)

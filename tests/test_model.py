import math

import pytest
import torch

import model as M
from helpers import ROOT
from lib.files import UserError
from lib.lora import add_lora
from lib.optim import build_optimizers
from lib.settings import defaults
from model import GPT, GPTConfig, attend, document_mask, filter_logits


def tiny(**kw):
    args = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**args, **kw})).eval()


def test_causal_and_logits_shape():
    model = tiny()
    idx = torch.randint(0, 97, (2, 20))
    logits, loss = model(idx)
    assert logits.shape == (2, 20, 97) and loss is None
    t = 11
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 97
    logits2, _ = model(changed)
    assert torch.equal(logits[:, :t], logits2[:, :t])  # nothing before t sees token t
    assert not torch.allclose(logits[:, t], logits2[:, t])  # but t itself does
    for T in (1, 2, 3):  # the shortest sequences too
        torch.testing.assert_close(model(idx[:, :T])[0], logits[:, :T])


def test_loss_matches_logits_and_ignores_minus_one():
    model = tiny()
    idx = torch.randint(0, 97, (2, 16))
    targets = torch.randint(0, 97, (2, 16))
    targets[0, :5] = -1
    logits, _ = model(idx)
    _, loss = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 97), targets.view(-1), ignore_index=-1)
    torch.testing.assert_close(loss, expected)


def naive_generate(model, idx, n, temperature, top_k, top_p=None):
    # full forward passes over the last block_size tokens, no cache
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size:])
        logits = logits[:, -1, :]
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            nxt = torch.multinomial(probs, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


# sampling with top_k goes through the same cache as greedy decoding: the quick tier keeps greedy. A temperature
# other than 1 and a top_p: those the draws take (each changes them, for these seeds)
@pytest.mark.parametrize("temperature,top_k,top_p", [(0, None, None),
                                                     pytest.param(1.0, 10, None, marks=pytest.mark.slow),
                                                     pytest.param(0.5, None, 0.5, marks=pytest.mark.slow)])
def test_kv_cache_generation_equals_full_forward(temperature, top_k, top_p):
    model = tiny()
    prompt = torch.randint(0, 97, (2, 5))
    n = 40  # runs past block_size=32, where the window slides
    torch.manual_seed(1)
    cached = model.generate(prompt, n, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(1)
    full = naive_generate(model, prompt, n, temperature, top_k, top_p)
    if temperature not in (0, 1):  # the draws differ where the temperature or top_p is left out
        for other in (dict(temperature=1.0, top_p=top_p), dict(temperature=temperature, top_p=None)):
            torch.manual_seed(1)
            assert not torch.equal(cached, naive_generate(model, prompt, n, other["temperature"], top_k,
                                                          other["top_p"]))
    assert cached.shape == (2, 45)
    assert torch.equal(cached, full)


def test_generation_makes_the_logits_of_the_last_position_alone():
    # a prompt of T tokens, and every step once past block_size, would make (T, V) logits for one row of them (a
    # fine-tuned Llama 3.1's 128k window: 31 GiB a step in bf16); made for the last position only, the same tokens
    model = tiny()
    made = []
    model.lm_head.register_forward_hook(lambda module, args, out: made.append(tuple(out.shape)))
    out = model.generate(torch.randint(0, 97, (2, 30)), 6, temperature=0)
    assert made == [(2, 1, 97)] * 6
    assert torch.equal(out, naive_generate(model, out[:, :30], 6, 0, None))


def test_grouped_query_attention_on_cuda_in_fp32_or_masked_repeats_keys_and_values_for_sdpa(monkeypatch):
    # SDPA's GQA runs on CUDA in its flash kernel (half, unmasked) or its math one, which keeps every head's (T, S)
    # scores (fp32 on a GPU without bf16; a dense document mask): there the keys and values are repeated for each
    # query head, for the memory-efficient kernel, the same attention. (x.is_cuda answered by memory.py's AskedAbout)
    from lib.memory import AskedAbout
    seen, sdpa = [], M.attend
    monkeypatch.setattr(M, "attend", lambda q, k, v, **kw: seen.append((k.size(2), kw["enable_gqa"])) or
                        sdpa(q, k, v, **kw))
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    plain = [M.attention(q, k, v, None, 0.0, True), M.attention(q, k, v, mask, 0.0, True)]
    with AskedAbout("cuda"):
        on_cuda = [M.attention(q, k, v, None, 0.0, True), M.attention(q, k, v, mask, 0.0, True)]
    assert seen == [(2, True), (2, True), (4, False), (4, False)]  # (heads of the keys SDPA got, enable_gqa)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, on_cuda))


def test_generation_stops_at_the_first_of_its_stop_ids():
    # stop: an id, or a list of them (sample.py --chat: end-of-turn and the folder's end-of-text ids)
    model = tiny()
    prompt = torch.randint(0, 97, (1, 5))
    written = model.generate(prompt, 12, temperature=0)[0, 5:].tolist()
    absent = next(i for i in range(97) if i not in written)
    first = written.index(written[3])  # (the same id may come earlier)
    assert model.generate(prompt, 12, temperature=0, stop=[absent, written[3]]).shape == (1, 5 + first + 1)
    assert model.generate(prompt, 12, temperature=0, stop=written[3]).shape == (1, 5 + first + 1)
    assert model.generate(prompt, 12, temperature=0, stop=[absent]).shape == (1, 17)


def test_generation_of_two_rows_stops_once_each_has_written_a_stop_id():
    # the rows write theirs at different steps, and never both at one step: generation ends at the later row's
    model = tiny()
    prompt = torch.randint(0, 97, (2, 5))
    torch.manual_seed(1)  # drawn (greedy, this tiny model writes one id over and over)
    written = model.generate(prompt, 12)[:, 5:].tolist()

    def first_stops(stop):  # the step at which each row first writes one of stop's ids
        return [next((k for k, t in enumerate(row) if t in stop), None) for row in written]
    stop = next([a, b] for a in written[0] for b in written[1] if None not in (firsts := first_stops({a, b}))
                and firsts[0] != firsts[1] and not any(x in (a, b) and y in (a, b) for x, y in zip(*written)))
    torch.manual_seed(1)
    assert model.generate(prompt, 12, stop=stop).shape == (2, 5 + max(first_stops(stop)) + 1)


def test_grouped_query_attention_shapes_and_params():
    gqa, mha = tiny(n_kv_head=1), tiny(n_kv_head=4)
    attn = gqa.blocks[0].attn  # 4 query heads, 1 key/value head, of 8
    assert (attn.q.weight.shape, attn.k.weight.shape, attn.v.weight.shape) == ((32, 32), (8, 32), (8, 32))
    assert mha.num_params() - gqa.num_params() == 2 * 2 * 3 * 8 * 32  # 2 layers, k and v, 3 heads fewer
    with pytest.raises(ValueError, match="divisible by n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3, n_embd=32)


def test_tied_and_untied_embeddings():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.num_params() - tied.num_params() == 97 * 32


def test_optimizer_groups_no_decay_on_vectors():
    model = tiny()
    opt = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                           "learning_rate": 1e-3, "weight_decay": 0.1}, "cpu")[0]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 2 * 2 + 1  # two norms per block and the final norm
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()


def counted_flops_per_token(model, T):
    # the FLOPs of one forward and backward of T-token sequences, per token, as torch's FlopCounterMode counts
    # them: every matmul, attention's too (through the math backend, whose matmuls it sees), with every input
    # gradient made (as the count convention has it, even where the embedding is frozen), plus what the
    # convention charges the parameters outside matmuls (norms, biases): 6 a value trained, 4 frozen
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    idx = torch.randint(0, model.config.vocab_size, (2, T))
    def needs_gradient(module, args, out):
        return out if out.requires_grad else out.detach().requires_grad_()
    hook = model.wte.register_forward_hook(needs_gradient)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        _, loss = model.train()(idx, idx)
        loss.backward()
    hook.remove()
    elementwise = sum((6 if p.requires_grad else 4) * p.numel() for p in model.parameters() if p.dim() < 2)
    return counter.get_total_flops() / idx.numel() + elementwise


# FlopCounterMode costs seconds a case: the quick tier keeps Qwen3's heads (head_size, q/k norms, biases: the
# most terms), the slow tier the others
@pytest.mark.parametrize("kw", [pytest.param(dict(), marks=pytest.mark.slow),
                                pytest.param(dict(tie_embeddings=False), marks=pytest.mark.slow),
                                pytest.param(dict(n_kv_head=1), marks=pytest.mark.slow),
                                dict(head_size=16, qk_norm=True, qkv_bias=True)])  # Qwen3's heads: 4 x 16 != 32
def test_flops_per_token(kw):
    # counted, not restated: 6 FLOPs a weight trained, 4 frozen (LoRA's base: no weight gradient), attention's
    # 12·L·H·Q·T, the embedding's lookup none (its matmul as the tied head only)
    model = tiny(**kw)
    assert model.flops_per_token() == counted_flops_per_token(model, 32)  # block_size by default
    assert model.flops_per_token(16) == counted_flops_per_token(model, 16)
    add_lora(model, 4)
    assert model.flops_per_token() == counted_flops_per_token(model, 32)


def test_filter_logits_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, top_p=0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 needs the 0.3 as well
    kept = filter_logits(logits, top_k=1).isfinite()
    assert kept.tolist() == [[True, False, False, False]]
    unsorted = torch.log(torch.tensor([[0.05, 0.3, 0.15, 0.5]]))  # kept by probability, not by place
    assert filter_logits(unsorted, top_p=0.7).isfinite().tolist() == [[False, True, False, True]]
    # a set whose mass is top_p exactly reaches it, as transformers' TopPLogitsWarper has it: nothing more is kept
    halves = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))  # (sums exact in binary)
    assert filter_logits(halves, top_p=0.5).isfinite().tolist() == [[True, False, False, False]]
    assert filter_logits(halves, top_p=0.75).isfinite().tolist() == [[True, True, False, False]]
    assert filter_logits(halves, top_p=0.0).isfinite().tolist() == [[True, False, False, False]]  # the likeliest
    assert torch.equal(filter_logits(logits, top_k=0), logits)  # 0 keeps all, as sample.py's --top_k=0 says


def test_sequence_longer_than_block_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        tiny()(torch.zeros(1, 33, dtype=torch.long))


def test_training_reduces_loss():
    model = tiny().train()
    opt = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                           "learning_rate": 3e-3, "weight_decay": 0.0}, "cpu")[0]
    idx = torch.randint(0, 97, (4, 32))
    first = None
    for _ in range(30):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or loss.item()
    assert first > math.log(97) - 0.5 and loss.item() < first / 2  # it memorises a fixed batch


def test_filled_cache_takes_one_token_at_a_time():
    model = tiny()
    cache = [[] for _ in model.blocks]
    model(torch.randint(0, 97, (1, 4)), cache=cache)
    assert cache[0][0].shape == (1, 4, 2, 8)  # (B, T, n_kv_head, head size)
    with pytest.raises(ValueError, match="one token at a time"):
        model(torch.randint(0, 97, (1, 2)), cache=cache)


def test_doc_mask_keeps_each_document_to_itself():
    # three documents packed in one sequence, end-of-text (id 0) beginning the second and the third
    model = tiny()
    idx = torch.randint(1, 97, (2, 24))
    idx[:, 8] = idx[:, 17] = 0
    docs = (idx == 0).cumsum(dim=1)  # as train.py numbers them: 0 for 0..7, 1 for 8..16, 2 for 17..23
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] % 96) + 1  # a token of the middle document, never end-of-text
    masked, masked2 = model(idx, doc_ids=docs)[0], model(changed, doc_ids=docs)[0]
    torch.testing.assert_close(masked[:, :12], masked2[:, :12], rtol=0, atol=0)  # before it: untouched
    torch.testing.assert_close(masked[:, 17:], masked2[:, 17:], rtol=0, atol=0)  # the next document too
    assert not torch.allclose(masked[:, 12:17], masked2[:, 12:17])  # its own document sees it
    plain, plain2 = model(idx)[0], model(changed)[0]
    assert not torch.allclose(plain[:, 17:], plain2[:, 17:])  # without doc_ids, the next document sees it
    torch.testing.assert_close(masked[:, :8], plain[:, :8])  # the first document is causal attention as always
    # a change in the first document never reaches the others either
    first = idx.clone()
    first[:, 3] = (first[:, 3] % 96) + 1
    torch.testing.assert_close(model(first, doc_ids=docs)[0][:, 8:], masked[:, 8:], rtol=0, atol=0)


def test_doc_mask_with_one_document_is_causal_attention():
    model = tiny()
    idx = torch.randint(1, 97, (2, 16))
    targets = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(model(idx, targets, doc_ids=torch.zeros_like(idx))[1], model(idx, targets)[1])


@pytest.mark.slow  # FlexAttention is compiled (~20 s)
def test_doc_mask_flex_attention_gives_the_sdpa_path_output():
    # doc_mask's CUDA path (FlexAttention's block mask and mask function) run forward on CPU, where FlexAttention
    # runs forward under compile, through the model's own attention with grouped-query heads: the boolean mask's
    # output with SDPA. Documents of uneven lengths, one ending inside a 128-token block, one sequence whole.
    model = tiny(block_size=160)
    docs = torch.zeros(2, 160, dtype=torch.long)
    docs[0, 50:], docs[0, 130:] = 1, 2
    x = torch.randn(2, 160, 32)
    cos, sin = model.cos[:160], model.sin[:160]
    attention = model.blocks[0].attn
    with torch.no_grad():
        flex = attention(x, cos, sin, mask=document_mask(docs, flex=True))
        sdpa = attention(x, cos, sin, mask=document_mask(docs))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sdpa, attention(x, cos, sin))  # the documents' mask is not causal attention's


@pytest.mark.skipif(not torch.cuda.is_available() or M.flash_attn_func is None, reason="needs a GPU and flash-attn")
def test_flash_attn_runs_in_training_under_autocast(monkeypatch):
    # with fp32 master weights under bf16 autocast, as train.py runs: flash-attn is called, and gives SDPA's output
    calls, flash_attn_func = [], M.flash_attn_func
    monkeypatch.setattr(M, "flash_attn_func", lambda *a, **kw: calls.append(1) or flash_attn_func(*a, **kw))
    model = tiny().cuda()
    idx = torch.randint(0, 97, (2, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        flash = model(idx, idx)[1]
        monkeypatch.setattr(M, "flash_attn_func", None)
        sdpa = model(idx, idx)[1]
    assert len(calls) == 2  # once a layer
    torch.testing.assert_close(flash, sdpa, rtol=1e-2, atol=0)


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(attn_mask=torch.rand(1, 1, 24, 24) < 0.7)])
def test_attention_under_cpu_bf16_autocast_runs_in_fp32(kwargs):
    # torch's CPU attention is much slower backward in bf16: under autocast it gets fp32 inputs and the
    # result comes back in bf16, with gradients in the inputs' dtype
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 24, 4, 16).bfloat16().requires_grad_() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attend(q, k, v, **kwargs)
        in_bf16 = torch.nn.functional.scaled_dot_product_attention(  # what autocast alone would compute
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs).transpose(1, 2)
    exact = attend(q.float(), k.float(), v.float(), **kwargs).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, exact) and not torch.equal(in_bf16, exact)
    y.sum().backward()
    assert q.grad.dtype == torch.bfloat16 and q.grad.abs().sum() > 0


def test_generation_takes_no_doc_ids():
    model = tiny()
    with pytest.raises(ValueError, match="generation takes no doc_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=[[] for _ in model.blocks], doc_ids=torch.zeros(1, 4))


def test_a_batch_whose_every_target_is_ignored_has_a_loss_of_zero():
    # a conversation cut before its answers: nothing to score, 0 (not 0/0's NaN, which would end a run)
    model = tiny()
    idx, targets = torch.randint(0, 97, (2, 8)), torch.full((2, 8), -1)
    assert model(idx, targets)[1].item() == 0.0
    assert [value.item() for value in model.loss_and_accuracy(idx, targets)] == [0.0, 0.0]


def test_accuracy_counts_the_last_id_of_the_vocabulary():
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight[96] *= 50  # the likeliest wherever its logit is above 0
    idx = torch.randint(0, 97, (3, 16))
    logits, _ = model(idx)
    right = (logits.argmax(-1) == 96).float().mean().item()
    assert right > 0 and model.loss_and_accuracy(idx, torch.full((3, 16), 96))[1].item() == right


@pytest.mark.parametrize("chunk_elements", [97, 5 * 97, 2**24])  # one row, five rows, all rows per chunk
def test_loss_and_accuracy_match_the_full_logits(chunk_elements):
    model = tiny()
    idx = torch.randint(0, 97, (3, 16))
    targets = torch.randint(0, 97, (3, 16))
    logits, _ = model(idx)
    targets[0, :4] = logits[0, :4].argmax(-1)  # some right answers, so that accuracy is not ~0
    targets[1, :3] = -1  # and some ignored positions
    loss, accuracy = model.loss_and_accuracy(idx, targets, chunk_elements=chunk_elements)
    kept = targets != -1
    expected = torch.nn.functional.cross_entropy(logits[kept], targets[kept])
    torch.testing.assert_close(loss, expected)
    assert accuracy.item() == (logits[kept].argmax(-1) == targets[kept]).float().mean().item()
    assert accuracy.item() >= 4 / kept.sum().item()


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "muon"])
def test_optimizers_cover_every_parameter_once(kind):
    model = tiny()
    optimizers = build_optimizers(model, {**defaults(), "optimizer": kind, "learning_rate": 1e-3,
                                  "weight_decay": 0.1, "beta1": 0.8, "beta2": 0.95, "muon_momentum": 0.85}, "cpu")
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) and sum(p.numel() for p in params) == model.num_params()
    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD, "muon": torch.optim.AdamW}
    assert type(optimizers[0]) is kinds[kind]  # (Adam adds its decay to the gradient, AdamW decays the weights)
    if kind != "sgd":
        assert optimizers[0].param_groups[0]["betas"] == (0.8, 0.95)
    if kind == "muon":
        adamw, muon = optimizers
        assert isinstance(muon, torch.optim.Muon) and muon.param_groups[0]["lr"] == 0.02
        assert (muon.param_groups[0]["weight_decay"], muon.param_groups[0]["momentum"]) == (0.1, 0.85)
        names = {id(p): n for n, p in model.named_parameters()}
        assert {names[id(p)].split(".")[-2] for p in muon.param_groups[0]["params"]} == {"q", "k", "v", "proj",
                                                                                         "gate", "up", "down"}
        assert model.wte.weight in adamw.param_groups[0]["params"]  # the embedding (and tied head): AdamW
    else:
        assert len(optimizers) == 1
    # a name that can never become an optimizer: the line names the setting and what it may be
    with pytest.raises(UserError, match="optimizer='no-such-optimizer' is not one of .*'adamw'"):
        build_optimizers(model, {**defaults(), "optimizer": "no-such-optimizer"}, "cpu")


@pytest.mark.slow  # FlexAttention is compiled (~20 s)
def test_flex_attention_gets_one_dtype_from_a_qwen3_under_bf16_autocast(monkeypatch):
    # Qwen3's qk-norm with fp32 norm weights (full fine-tuning) makes q and k fp32 beside a bf16 v under autocast;
    # FlexAttention runs outside autocast and wants one dtype (mixed, it raises or runs all in fp32): it gets
    # autocast's (forward only: on CPU it has no backward)
    model = tiny(head_size=16, qk_norm=True, block_size=128)
    docs = torch.zeros(2, 128, dtype=torch.long)
    docs[:, 40:] = 1
    x = torch.randn(2, 128, 32)
    block_mask = document_mask(docs, flex=True)  # (compiled: eager makes it from the whole (B, T, T) mask first)
    from torch.nn.attention.flex_attention import create_block_mask
    eager = create_block_mask(lambda b, h, q, k: (k <= q) & (docs[b, q] == docs[b, k]), 2, None, 128, 128)
    assert torch.equal(block_mask.to_dense(), eager.to_dense())
    seen, flex_attention = [], M.flex_attention
    monkeypatch.setattr(M, "flex_attention", lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or
                        flex_attention(q, k, v, **kw))
    attention = model.blocks[0].attn
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        flex = attention(x, model.cos[:128], model.sin[:128], mask=block_mask)
        sdpa = attention(x, model.cos[:128], model.sin[:128], mask=document_mask(docs))
    assert seen == [(torch.bfloat16,) * 3]
    torch.testing.assert_close(flex.float(), sdpa.float(), rtol=0.05, atol=0.02)


@pytest.mark.slow  # the model and FlexAttention are compiled (~20-60 s)
def test_a_compiled_model_takes_block_masks_made_outside_without_recompiling():
    # doc_mask's block mask made inside a compiled model is a new function each batch: a recompile each time.
    # Made outside (as train.py does), two batches with different documents run the one compiled graph; and the
    # compiled maker of the mask runs once, made as in training (grad, autocast), then as in evaluation. (torch's
    # config.patch, not monkeypatch: undoing a ConfigModule attribute deletes it for the rest of the process.)
    import torch._dynamo
    torch._dynamo.reset()
    model = tiny(block_size=128, n_layer=1)
    compiled = torch.compile(model)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for cut, making in ((40, torch.autocast("cpu", dtype=torch.bfloat16)), (90, torch.no_grad())):
            idx = torch.randint(1, 97, (2, 128))
            docs = (torch.arange(128) >= cut).long().expand(2, 128)
            with making:
                mask = document_mask(docs, flex=True)
            with torch.no_grad():  # FlexAttention has no backward on CPU
                logits = compiled(idx, mask=mask)[0]
                torch.testing.assert_close(logits, model(idx, doc_ids=docs)[0], rtol=1e-4, atol=1e-4)


def test_use_kernels_none_follows_the_device_a_call_runs_on(monkeypatch):
    # On a machine with a GPU, a CPU run (the tests', --device=cpu) must not put the fused ops in Triton's
    # interpreter: use_kernels=None picks by the device of each call's input, not by the machine's GPU
    import kernels
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("rms_norm", "swiglu", "apply_rotary", "linear_cross_entropy"):
        monkeypatch.setattr(kernels, name, lambda *args, name=name: pytest.fail(f"the fused {name} ran on CPU"))
    model = tiny().train()
    idx = torch.randint(0, 97, (2, 16))
    model(idx, idx)[1].backward()
    assert model.config.use_kernels is None


@pytest.mark.slow  # new Pythons, each importing torch: ~25 s
def test_kernels_py_is_read_only_where_a_call_fuses():
    # use_kernels=None on a CPU runs model.py's plain ops: kernels.py (and Triton with it) is imported at the one
    # place the option is taken, so a CPU run never reads it, and use_kernels=True does. A new Python: the tests'
    # own process has imported it by now.
    import subprocess
    import sys
    code = ("import sys, torch\nfrom model import GPT, GPTConfig\nx = torch.randint(0, 64, (2, 16))\n"
            "for fuse in (None, True):\n"
            "    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32,\n"
            "                          use_kernels=fuse))\n"
            "    model(x, x)[1].backward()\n    model.generate(x[:, :2], 3)\n"
            "    print('kernels' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stderr

# greedy decoding and sampling both choose from logits cut at vocab= first: the quick tier keeps sampling
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_generate_never_draws_the_padding_rows_past_the_tokenizers_vocabulary(temperature):
    # vocab_size is the tokenizer's rounded up to a multiple of 64: the rows past it decode to nothing (sample.py
    # died on such an id), so generate(vocab=) leaves them out, however likely the model makes them
    model = tiny(vocab_size=128, tie_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight[97:] = 5 * model.lm_head.weight[:31].abs().max()  # the padding rows: likely
    prompt = torch.randint(0, 97, (2, 5))
    torch.manual_seed(0)
    assert (model.generate(prompt, 20, temperature=temperature)[:, 5:] >= 97).any()
    torch.manual_seed(0)
    assert (model.generate(prompt, 20, temperature=temperature, vocab=97)[:, 5:] < 97).all()


def test_a_temperature_too_low_to_divide_by_is_greedy():
    # logits divided by 1e-45 overflow to inf, and inf - inf is NaN: no distribution to draw from, so greedy
    model, prompt = tiny().eval(), torch.randint(0, 97, (2, 5))
    assert torch.equal(model.generate(prompt, 8, temperature=1e-45), model.generate(prompt, 8, temperature=0))


def test_use_kernels_none_under_compile_keeps_only_the_fused_loss(monkeypatch):
    # measured on an H200 (BENCHMARKS.md, 2026-11-27): in a compiled step Inductor's fusion of the references
    # beats the opaque fused norm, SwiGLU and rotary, while the fused loss still wins; eager, all four are fused
    from model import fused
    on_cuda = type("CudaInput", (), {"is_cuda": True})()
    assert fused(None, on_cuda) and fused(None, on_cuda, compiled_too=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused(None, on_cuda) and fused(None, on_cuda, compiled_too=True)
    assert fused(True, on_cuda) and not fused(False, on_cuda, compiled_too=True)  # an explicit choice stands
    assert not fused(None, torch.zeros(1), compiled_too=True)  # a CPU call: the references


def test_tensor_parallel_heads_draw_their_own_attention_dropout():
    # Under tensor parallel every process of a replica holds the same random state (the residual stream's dropout
    # must agree) and computes attention on its own heads: parallelize gives each attention in its own stream, so
    # process 1's heads do not reuse process 0's attention-dropout masks, while the shared stream advances alike
    from functools import partial
    from lib.parallel import attention_in_stream
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.5))
    idx = torch.randint(0, 64, (2, 16))
    outs, states = [], []
    for stream in (0, 1):  # two processes' copies of the same heads, from the same random state
        model.blocks[0].attn.attend_in_stream = partial(attention_in_stream, stream)
        torch.manual_seed(1)
        outs.append(model(idx)[0])
        states.append(torch.get_rng_state())
    assert not torch.allclose(outs[0], outs[1])
    assert torch.equal(states[0], states[1])


def test_generation_of_a_doc_mask_run_sees_only_its_document():
    # doc_mask trains (and eval.py scores) a token on the tokens of its own document, end-of-text beginning one: a
    # sample past an end-of-text attended to the documents before it, a context the model never saw (the val loss of
    # a small doc_mask run: 1.03 within documents, 1.42 across). generate(document=eot) is the doc-masked forward's
    model, eot = tiny(vocab_size=8).eval(), 3  # a small vocabulary: end-of-text drawn often
    prompt = torch.tensor([[5, 1, eot, 7, 0, 6, eot, 2]])
    torch.manual_seed(2)
    # past block_size=32 too; at a low temperature, where the draws follow the logits closely (at 1 this tiny
    # model's are near uniform: draws with every document in view were the same)
    cached = model.generate(prompt, 60, temperature=0.3, document=eot)
    torch.manual_seed(2)
    idx = prompt
    with torch.no_grad():
        for _ in range(60):
            window = idx[:, -model.config.block_size:]
            logits, _ = model(window, doc_ids=(window == eot).cumsum(dim=1))
            idx = torch.cat([idx, torch.multinomial(torch.softmax(logits[:, -1] / 0.3, dim=-1), 1)], dim=1)
    assert (idx[0, 8:] == eot).sum() >= 2  # new documents begun while sampling, not only in the prompt
    assert torch.equal(cached, idx)
    seen = []  # the first step reads the prompt's last document alone
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].tolist()))
    model.generate(prompt, 1, document=eot)
    assert seen == [[[eot, 2]]]


def test_attention_within_documents_drops_as_asked():
    # doc_mask's boolean mask: its attention dropout as the causal path's, not left out
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    mask = document_mask(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]), flex=False)
    assert not torch.allclose(M.attention(q, k, v, mask, 0.5, True), M.attention(q, k, v, mask, 0.0, True))


def test_shapes_and_calls_the_model_cannot_take_are_refused_in_a_line():
    with pytest.raises(ValueError, match="head size 3 must be even"):
        GPTConfig(n_embd=12, n_head=4)
    model = tiny()
    cache = [[] for _ in model.blocks]
    model(torch.zeros(1, 32, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="sequence of 33 tokens is longer than block_size=32"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="generation takes no doc_ids"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=[[] for _ in model.blocks], mask=torch.ones(1, 1, 2, 2) > 0)
    with pytest.raises(ValueError, match="takes one row"):
        model.generate(torch.zeros(2, 3, dtype=torch.long), 1, document=3)


def test_a_model_in_eval_mode_drops_nothing_and_its_residual_projections_start_smaller():
    model, ids = tiny(dropout=0.5), torch.randint(0, 97, (2, 16))  # (eval mode)
    assert torch.equal(model(ids)[0], model(ids)[0])  # attention's dropout too
    model.train()
    assert not torch.equal(model(ids)[0], model(ids)[0])
    # every matrix drawn with std 0.02, the projections into the residual stream with 0.02 / sqrt(2 n_layer) (GPT-2's);
    # a std estimated from n >= 24,832 values is within 0.5% of the true one (one standard error), 5% is 10 of them
    model = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=4, n_head=4, n_embd=256))
    for name, p in model.named_parameters():
        if p.dim() == 2:
            scaled = name.endswith(("attn.proj.weight", "mlp.down.weight"))
            assert p.std().item() == pytest.approx(0.02 / (8 ** 0.5 if scaled else 1), rel=0.05), name

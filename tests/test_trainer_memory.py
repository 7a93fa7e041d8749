"""The trainer's memory layout (`TrainConfig`, `train/logprobs.py`): packed passes equal padded
ones, chunked logprobs equal the full log-softmax, checkpointing leaves gradients unchanged,
micro-batches respect their token budget. All on a tiny random Llama, fp32."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tiller.algorithms.registry import POLICY_LOSSES
from tiller.config import CriticConfig, RLConfig, TrainConfig
from tiller.train.batch import Batch, micro_batches
from tiller.train.critic import Critic
from tiller.train.distributed import RankRows
from tiller.train.logprobs import PassShape, _chunk, token_logprobs
from tiller.train.trainer import PolicyTrainer, _on

VOCAB = 97


def tiny_llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, attn_implementation=attn)
    return LlamaForCausalLM(cfg).float()


def ragged_batch(lengths: tuple[int, ...] = (7, 3, 11, 5)) -> Batch:
    gen = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=gen)
        attn[i, :n] = 1
    mask = attn.float()
    mask[:, 0] = 0
    return Batch(ids, attn, mask, torch.zeros(mask.shape), torch.zeros(len(lengths)),
                 torch.zeros(len(lengths), dtype=torch.long))


def full_logprobs(model: LlamaForCausalLM, batch: Batch, temperature: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked, padded reference: the whole [B, T, V] log-softmax at once."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    pad = logp.new_zeros((logp.size(0), 1))
    keep = batch.attention_mask.float()
    return torch.cat([pad, logp], 1) * keep, torch.cat([pad, ent], 1) * keep


def test_chunk_hand_computed() -> None:
    # logits (0, ln 2, 0): q = (1/4, 1/2, 1/4), log q(1) = -ln 2, H = 1.5 ln 2
    head = torch.nn.Linear(1, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [math.log(2)], [0.0]]))
    logp, ent = _chunk(head, torch.ones(1, 1), torch.tensor([1]), 1.0, True, 0, 1.0)
    assert logp.item() == pytest.approx(-math.log(2), abs=1e-7)
    assert ent.item() == pytest.approx(1.5 * math.log(2), abs=1e-7)
    # at T = 0.5 the logits double: q = (1/6, 4/6, 1/6)
    logp, _ = _chunk(head, torch.ones(1, 1), torch.tensor([0]), 0.5, False, 0, 1.0)
    assert logp.item() == pytest.approx(math.log(1 / 6), abs=1e-6)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_and_packed_equal_full(packing: bool, chunk: int) -> None:
    model = tiny_llama()
    batch = ragged_batch()
    ref_logp, ref_ent = full_logprobs(model, batch, temperature=0.7)
    (ref_logp * batch.loss_mask).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp, ent = token_logprobs(model, batch, 0.7, with_entropy=True,
                               shape=PassShape(packing=packing, chunk_tokens=chunk))
    (logp * batch.loss_mask).sum().backward()
    assert torch.allclose(logp, ref_logp, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ref_ent, atol=1e-5, rtol=0)
    assert logp[1, 3:].abs().sum() == 0  # nothing off a row's length
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        assert torch.allclose(p.grad, g, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("packing", [False, True])
def test_loss_only_equals_full_on_the_mask(packing: bool) -> None:
    """The head on the loss positions only: the same values, entropies and gradients there,
    0 everywhere else; a pass with no loss token still backpropagates (zero gradients)."""
    model = tiny_llama()
    batch = ragged_batch()
    batch.loss_mask[:, :4] = 0  # a prompt of 4 tokens on each row
    mask = batch.loss_mask
    ref_logp, ref_ent = full_logprobs(model, batch, temperature=0.7)
    (ref_logp * mask).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp, ent = token_logprobs(model, batch, 0.7, with_entropy=True, loss_only=True,
                               shape=PassShape(packing=packing, chunk_tokens=3))
    (logp * mask).sum().backward()
    assert torch.allclose(logp, ref_logp * mask, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ref_ent * mask, atol=1e-5, rtol=0)
    assert int((logp != 0).sum()) == int(mask.sum()) == 11  # 3 + 0 + 7 + 1 loss tokens
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        assert torch.allclose(p.grad, g, atol=1e-5, rtol=1e-4)
    model.zero_grad()
    empty = ragged_batch()
    empty.loss_mask.zero_()
    logp, ent = token_logprobs(model, empty, with_entropy=True, loss_only=True,
                               shape=PassShape(packing=packing))
    (logp * empty.loss_mask).sum().backward()
    assert logp.requires_grad and all(p.grad.abs().sum() == 0 for p in model.parameters())
    assert int((logp != 0).sum()) == int((ent != 0).sum()) == 0  # the kept position too


@pytest.mark.parametrize("loss", ["ppo_clip", "sapo"])
def test_an_empty_pass_reads_zeros_and_its_gradient_stays_finite(loss: str) -> None:
    """A rank short of rows runs an empty pass on another rank's row (index row - B): its
    logprobs are 0 (no loss token), so it must read logp_old, advantages and references as 0
    too. Read from the real row, a logp_old of -100 gives a ratio exp(0 + 100) = inf and, in
    the backward, inf x 0 = NaN summed into every rank's weights."""
    model = tiny_llama()
    empty = ragged_batch()
    empty.loss_mask.zero_()
    logp, _ = token_logprobs(model, empty, loss_only=True, shape=PassShape(packing=True))
    rows = torch.arange(4) - 4  # every row an empty pass's
    width = logp.size(1)
    old = _on(torch.full((4, width), -100.0), rows, width, torch.device("cpu"))
    adv = _on(torch.ones(4, width), rows, width, torch.device("cpu"))
    assert old.abs().sum() == 0 and adv.abs().sum() == 0
    loss_tok, _ = POLICY_LOSSES[loss](logp, old, adv, empty.loss_mask)
    (loss_tok * empty.loss_mask).sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) and p.grad.abs().sum() == 0
               for p in model.parameters())
    batch = ragged_batch()
    batch.rollout_logprobs.fill_(-100.0)
    mb = RankRows(TrainConfig(), rank=0, world=2).pass_batch(batch, rows, torch.device("cpu"))
    assert mb.loss_mask.abs().sum() == 0 and mb.rollout_logprobs.abs().sum() == 0


def test_packing_eager_attention_equals_padded() -> None:
    model = tiny_llama("eager")
    batch = ragged_batch()
    with torch.no_grad():
        padded, _ = token_logprobs(model, batch, shape=PassShape(packing=False))
        packed, _ = token_logprobs(model, batch, shape=PassShape(packing=True))
    assert torch.allclose(packed, padded, atol=1e-5, rtol=0)
    assert packed.abs().sum() > 0


def test_packing_is_not_attention_across_sequences() -> None:
    """A packed row whose position ids did not restart would let a sequence see the previous
    one: the second sequence's logprobs then differ from its own pass."""
    model = tiny_llama()
    batch = ragged_batch((6, 6))
    with torch.no_grad():
        packed, _ = token_logprobs(model, batch, shape=PassShape(packing=True))
        alone = [token_logprobs(model, batch.rows(torch.tensor([i])))[0] for i in (0, 1)]
        hidden = model.model(input_ids=batch.input_ids.reshape(1, -1)).last_hidden_state
        joined = torch.log_softmax(model.lm_head(hidden[0, 5:-1]), -1)
    assert torch.allclose(packed[1], alone[1][0], atol=1e-5)
    crossed = joined.gather(-1, batch.input_ids[1, :, None])[1:, 0]
    assert not torch.allclose(crossed, packed[1, 1:], atol=1e-3)


def test_activation_checkpointing_same_grads() -> None:
    batch = ragged_batch()
    grads, kept = [], []

    def count_bytes(t: torch.Tensor) -> torch.Tensor:
        kept[-1] += t.numel() * t.element_size()
        return t
    for on in (False, True):
        kept.append(0)
        model = tiny_llama()
        trainer = PolicyTrainer(model, train=TrainConfig(activation_checkpointing=on))
        trainer._train_mode()
        assert model.model.layers[0].training is on  # the flag transformers checks
        assert model.model.layers[0].self_attn.training is False  # dropout stays off
        with torch.autograd.graph.saved_tensors_hooks(count_bytes, lambda t: t):
            logp, _ = trainer._forward(model, batch, 1.0)
        (logp * batch.loss_mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert kept[1] < kept[0] / 2  # autograd keeps only each layer's input


def test_chunking_saves_less_for_backward() -> None:
    """The bytes autograd keeps for the backward pass: the full log-softmax keeps [T, V]
    float32 matrices, the chunked one only the hidden states and per-token values."""
    model = tiny_llama()
    batch = ragged_batch((40, 40, 40, 40))

    def saved_bytes(fn) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if t.dim() >= 2 and t.size(-1) == VOCAB and t.dtype == torch.float32:
                total += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total

    full = saved_bytes(lambda: full_logprobs(model, batch))
    chunked = saved_bytes(lambda: token_logprobs(model, batch, shape=PassShape(chunk_tokens=8)))
    assert full >= 156 * VOCAB * 4  # at least one [tokens, V] fp32 matrix
    assert chunked < full / 10


def test_micro_batches_token_budget() -> None:
    lengths = torch.tensor([5, 100, 7, 30, 9])
    # padded: rows x longest, shortest first: [5, 7, 9] = 27 <= 30, then 30, then 100 alone
    padded = micro_batches(lengths, 8, max_tokens=30)
    assert [t.tolist() for t in padded] == [[0, 2, 4], [3], [1]]
    # packed: sums: 5 + 7 + 9 = 21 <= 30, 30, 100
    packed = micro_batches(lengths, 8, max_tokens=40, packed=True)
    assert [t.tolist() for t in packed] == [[0, 2, 4], [3], [1]]
    assert [t.tolist() for t in micro_batches(lengths, 2, max_tokens=1000, packed=True)] == \
        [[0, 2], [4, 3], [1]]
    assert [t.tolist() for t in micro_batches(lengths, 2)] == [[0, 2], [4, 3], [1]]


def test_critic_packed_and_checkpointed_equal_padded() -> None:
    """The critic's values and value-loss gradients: the same packed, checkpointed and with a
    token budget as padded (head made non-zero so the values carry the trunk's output); and
    the options engage: the packed passes' inputs are single rows of at most 12 tokens (26 in
    all, no padding), and checkpointing runs each layer twice per update micro-batch (a
    pre-hook inside the layer: the layer's own hooks stay outside the checkpoint, and the
    recomputation stops early once the last saved tensor is back, before a forward hook would
    fire)."""
    batch = ragged_batch()
    returns = torch.linspace(-1, 1, batch.loss_mask.numel()).view_as(batch.loss_mask)
    out, shapes, layer_calls = [], [], []
    for train in (TrainConfig(), TrainConfig(packing=True, activation_checkpointing=True,
                                             micro_batch_tokens=12)):
        critic = Critic(tiny_llama(), CriticConfig(), train=train)
        torch.nn.init.normal_(critic.model.head.weight, generator=torch.Generator().manual_seed(3))
        shapes.append([])
        critic.model.backbone.register_forward_pre_hook(
            lambda _m, _a, kw, seen=shapes[-1]: seen.append(tuple(kw["input_ids"].shape)),
            with_kwargs=True)
        values = critic.values(batch, micro_batch_size=8)
        cfg = RLConfig(micro_batch_size=8, max_grad_norm=1e9, algorithm={"advantage": "gae"})
        critic.optimizer = torch.optim.SGD(critic.model.parameters(), lr=0.1)
        calls = [0]
        layer_calls.append(calls)
        critic.model.backbone.layers[0].mlp.register_forward_pre_hook(
            lambda *_args, calls=calls: calls.__setitem__(0, calls[0] + 1))
        critic.update(batch, returns, values, cfg, l_max=16)
        out.append((values, [p.detach().clone() for p in critic.model.parameters()]))
    (v0, w0), (v1, w1) = out
    assert shapes[0] == [(4, 11), (4, 11)]  # padded: one micro-batch, values then update
    packed = shapes[1][: len(shapes[1]) // 2]
    assert shapes[1] == packed * 2 and len(packed) > 1
    assert all(rows == 1 and width <= 12 for rows, width in packed)
    assert sum(width for _, width in packed) == 26
    assert layer_calls == [[1], [2 * len(packed)]]  # checkpointing recomputes the layer
    assert torch.allclose(v0, v1, atol=1e-5) and v0[:, 1:].abs().sum() > 0
    assert v0[1, 3:].abs().sum() == 0  # nothing off a row's length
    for a, b in zip(w0, w1, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_critic_backbone_trains_under_lora() -> None:
    """Under model.lora the critic is built from the merged model, whose tensors are frozen
    (`Lora.merged`): the critic's copy of the transformer must train all the same, every
    backbone tensor moved by one update, not the head alone."""
    from tiller.config import LoRAConfig
    from tiller.train.lora import Lora

    lora = Lora(tiny_llama(), LoRAConfig(r=4))
    critic = Critic(lora.merged, CriticConfig())
    torch.nn.init.normal_(critic.model.head.weight, generator=torch.Generator().manual_seed(3))
    before = {n: p.detach().clone() for n, p in critic.model.backbone.named_parameters()}
    batch = ragged_batch()
    returns = torch.linspace(-1, 1, batch.loss_mask.numel()).view_as(batch.loss_mask)
    values = critic.values(batch, micro_batch_size=8)
    cfg = RLConfig(micro_batch_size=8, algorithm={"advantage": "gae"})
    critic.update(batch, returns, values, cfg, l_max=16)
    after = dict(critic.model.backbone.named_parameters())
    assert set(after) == set(before) and len(before) > 10
    unmoved = [n for n, p in after.items() if torch.equal(p.detach(), before[n])]
    assert unmoved == []
    # the policy's merged model (what the engine reads) is untouched and still frozen
    assert not any(p.requires_grad for p in lora.merged.parameters())


def tiny_granite(logits_scaling: float) -> torch.nn.Module:
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    cfg = GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        logits_scaling=logits_scaling)
    return GraniteForCausalLM(cfg).float()


def test_a_head_that_post_processes_its_logits_is_refused() -> None:
    """Granite divides its logits by `logits_scaling`: the chunked output layer would be off
    by that factor, silently. The trainer refuses it at start-up in one line naming the
    class; with logits_scaling 1 the same model is accepted and its logprobs are exact."""
    with pytest.raises(ValueError, match=r"^GraniteForCausalLM: its logits are not its output "
                                         r"layer on the last hidden states \(max difference "):
        PolicyTrainer(tiny_granite(8.0))
    model = tiny_granite(1.0)
    trainer = PolicyTrainer(model)
    batch = ragged_batch()
    with torch.no_grad():
        logp, _ = trainer._forward(model, batch, 1.0)
        ref, _ = full_logprobs(model, batch)
    assert torch.allclose(logp, ref, atol=1e-5, rtol=0)


def test_no_vocabulary_wide_tensor_beyond_a_chunk() -> None:
    """Every tensor the forward and backward passes create with the vocabulary as last
    dimension has at most `chunk_tokens` rows: recorded at the dispatcher (saved-tensor hooks
    cannot see inside the chunks' non-reentrant checkpoint). Views are not new memory; the
    output layer's weight-sized tensors ([V, H] and the gradient of its transpose) are the
    weight's, not the positions'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny_llama()
    weight = model.lm_head.weight.numel()
    rows: list[int] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.size(-1) == VOCAB
                            and t.numel() != weight):
                        rows.append(t.numel() // VOCAB)
            return out

    batch = ragged_batch((40, 40, 40, 40))
    with Record():
        logp, ent = token_logprobs(model, batch, with_entropy=True,
                                   shape=PassShape(chunk_tokens=8))
        (logp * batch.loss_mask + ent).sum().backward()
    assert rows and max(rows) == 8  # 156 predicting positions, never more than 8 at once

"""Draft distillation: architecture cost, the embedding basis, the loss, batch order, resumable training,
teacher shards, and agreement under the draft's streaming cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from cache import POLICIES
from cascade.checkpoint import load_model
from cascade.draft.agreement import draft_predictions, greedy_agreement, target_predictions
from cascade.draft.architecture import DraftShape, draft_config, hidden_basis, initialised_draft, macs_per_token
from cascade.draft.teacher import TeacherPlan, load_shards, windows, write_shard
from cascade.draft.training import Trainer, TrainPlan, batch_indices, distillation_loss
from tests.conftest import make_checkpoint

VOCAB = 320


def tiny_target_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def tiny_shape() -> DraftShape:
    return DraftShape(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=48, context_length=64
    )


def test_smollm2_draft_costs_about_a_tenth_of_the_target(smollm2_dir):
    target = AutoConfig.from_pretrained(smollm2_dir)
    assert macs_per_token(target) == 30 * (576 * 64 * 2 * (9 + 3) + 3 * 576 * 1536) + 49152 * 576
    ratio = macs_per_token(draft_config(target, DraftShape())) / macs_per_token(target)
    assert 0.05 < ratio <= 0.10


def test_hidden_basis_is_orthonormal_and_keeps_the_dominant_directions():
    torch.manual_seed(0)
    directions = torch.linalg.qr(torch.randn(16, 16))[0]  # [D, D] orthonormal
    scales = torch.tensor([10.0, 5.0] + [0.1] * 14)
    hidden = torch.randn(4000, 16) * scales @ directions.T  # [N, D], variance along the first two
    basis = hidden_basis(hidden, 2)  # [D, 2]
    assert torch.allclose(basis.T @ basis, torch.eye(2), atol=1e-5)
    overlap = (basis.T @ directions[:, :2]).abs()  # cosines with the true top directions
    assert overlap.max(dim=1).values.min() > 0.99


def test_initialised_draft_embeds_tokens_in_the_target_hidden_basis():
    torch.manual_seed(0)
    embedding, hidden = torch.randn(VOCAB, 64), torch.randn(500, 64)
    draft = initialised_draft(draft_config(tiny_target_config(), tiny_shape()), embedding, hidden, seed=0)
    expected = embedding @ hidden_basis(hidden, 32)
    assert torch.allclose(draft.model.embed_tokens.weight, expected, atol=1e-5)
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()  # tied


def test_loss_is_zero_kl_when_the_draft_is_the_target_on_its_top_k():
    top_ids = torch.tensor([[[3, 1, 7]]])  # [B=1, W=1, K=3]
    top_logprobs = torch.tensor([[[-0.2, -2.0, -3.0]]]).half()
    logits = torch.full((1, 1, 10), -1e9)
    logits[0, 0, top_ids[0, 0]] = top_logprobs[0, 0].float()  # same distribution on the top 3, nothing else
    _, metrics = distillation_loss(logits, torch.tensor([[3]]), top_ids, top_logprobs, ce_weight=0.0)
    assert abs(metrics.kl) < 1e-5 and metrics.agreement == 1.0
    logits[0, 0, 9] = 5.0  # mass moved to a token the target ranks nowhere: positive KL, no agreement
    _, worse = distillation_loss(logits, torch.tensor([[3]]), top_ids, top_logprobs, ce_weight=0.0)
    assert worse.kl > 1.0 and worse.agreement == 0.0


def test_batch_order_is_seeded_and_each_epoch_visits_every_window_once():
    first_epoch = torch.cat([batch_indices(step, 4, 10, seed=3) for step in range(5)])  # 20 = two epochs
    assert sorted(first_epoch[:10].tolist()) == list(range(10)) == sorted(first_epoch[10:].tolist())
    assert torch.equal(batch_indices(2, 4, 10, seed=3), batch_indices(2, 4, 10, seed=3))
    assert not torch.equal(batch_indices(0, 4, 10, seed=3), batch_indices(0, 4, 10, seed=4))


def fake_teacher_data(count: int = 12, window: int = 16, k: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(count, window, k, generator=generator), -1).sort(-1, descending=True)
    return {
        "tokens": torch.randint(0, VOCAB, (count, window), generator=generator, dtype=torch.int32),
        "top_ids": torch.randint(0, VOCAB, (count, window, k), generator=generator, dtype=torch.int32),
        "top_logprobs": logprobs.values.half(),
    }


def test_training_resumed_from_a_checkpoint_ends_where_an_uninterrupted_run_ends(tmp_path):
    config = draft_config(tiny_target_config(), tiny_shape())
    plan = TrainPlan(steps=4, batch=3, warmup=1, checkpoint_every=2)
    data = fake_teacher_data()

    def trainer(path):
        torch.manual_seed(0)
        return Trainer(LlamaForCausalLM(config), data, plan, path, torch.device("cpu"))

    straight = trainer(tmp_path / "straight.pt")
    straight.run(lambda step, metrics: None)

    class Killed(Exception):
        pass

    def kill_after_step_3(step, metrics):
        if step == 3:
            raise Killed

    interrupted = trainer(tmp_path / "resumed.pt")
    with pytest.raises(Killed):
        interrupted.run(kill_after_step_3)
    assert interrupted.step == 3  # killed after step 3; the checkpoint holds step 2
    resumed = trainer(tmp_path / "resumed.pt")
    assert resumed.step == 2
    resumed.run(lambda step, metrics: None)
    for (name, a), b in zip(straight.draft.state_dict().items(), resumed.draft.state_dict().values()):
        assert torch.equal(a, b), name


def test_training_lowers_the_distillation_loss(tmp_path):
    torch.manual_seed(0)
    data = fake_teacher_data(count=4)
    trainer = Trainer(
        LlamaForCausalLM(draft_config(tiny_target_config(), tiny_shape())),
        data,
        TrainPlan(steps=30, batch=4, warmup=1, lr=1e-2),
        tmp_path / "c.pt",
        torch.device("cpu"),
    )
    losses = []
    trainer.run(lambda step, metrics: losses.append(metrics.kl))
    assert losses[-1] < 0.7 * losses[0]


def test_teacher_shards_are_draft_windows_of_the_target_top_k(tmp_path):
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_target_config()).eval()
    plan = TeacherPlan(window=8, top_k=5)
    tokens = torch.randint(0, VOCAB, (2, 20))
    hidden = write_shard(tmp_path / "corpus-00000.pt", tokens, target, plan)
    shard = load_shards(tmp_path)
    assert shard["tokens"].shape == (4, 8) and shard["top_ids"].shape == (4, 8, 5)  # 2 x 20 -> 4 windows of 8
    assert torch.equal(shard["tokens"][1].long(), tokens[0, 8:16])
    reference = torch.log_softmax(target(tokens).logits.float(), -1)  # [2, 20, V]
    assert torch.equal(shard["top_ids"][2].long(), reference[1, :8].topk(5).indices)
    assert torch.allclose(shard["top_logprobs"][2].float(), reference[1, :8].topk(5).values, atol=2e-3)
    assert hidden.shape == (2, 20, 64)
    assert not list(tmp_path.glob("*.partial"))


def test_windows_drop_the_remainder():
    assert windows(torch.arange(10)[None], 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_agreement_of_a_model_with_itself_is_one_and_with_another_is_less(tmp_path):
    model_a = load_model(make_checkpoint(tmp_path / "a", "llama-gqa-tied", VOCAB), torch.float32, torch.device("cpu"))
    model_b = load_model(
        make_checkpoint(tmp_path / "b", "llama-gqa-tied", VOCAB, seed=1), torch.float32, torch.device("cpu")
    )
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(0))
    wide = POLICIES["streaming"].config(sinks=4, window=400)  # holds everything: the draft sees what the target sees
    assert torch.equal(draft_predictions(model_a, ids, 40, wide), target_predictions(model_a, ids, 40))
    assert greedy_agreement(model_a, model_a, ids, 40, wide) == 1.0
    assert greedy_agreement(model_a, model_b, ids, 40, wide) < 0.9

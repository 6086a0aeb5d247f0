"""The training forward and loop on the real bundled SmolLM2: logits equal to the engine's path, a few
SR-STE steps from a 2:4-pruned copy (its first 6 layers) lower the held-out loss and leave a 2:4 model, and a
trained early exit lowers its KL and drafts plain greedy output through self:24."""

import pytest
import torch

from leanlm.compress import MagnitudeConfig, compress, read_calibration_text
from leanlm.compress.prune.sparsity import satisfies_nm
from leanlm.model.forward import logits
from leanlm.model.llama import build_model
from leanlm.train.data import TokenWindows
from leanlm.train.sparse import SRSTEConfig
from leanlm.train.trainer import TrainConfig, Trainer
from tests.compress.conftest import dense_logits
from tests.train.conftest import teacher_divergence

pytestmark = pytest.mark.real_model


def test_training_forward_equals_the_engine_path_on_smollm2(smollm):
    model = build_model(smollm.config, smollm.state_dict, torch.float32)
    ids = torch.tensor([smollm.tokenizer.encode("The Eiffel Tower is a wrought-iron lattice tower in Paris.")])
    with torch.no_grad():
        torch.testing.assert_close(logits(model, ids), dense_logits(model, ids), rtol=0, atol=2e-4)


def test_sr_ste_steps_recover_a_2_4_smollm2(smollm):
    # its first 6 layers (and the real embedding, norm and head): the loop on real weights at a fifth of the cost
    full = build_model(smollm.config, {k: v.clone() for k, v in smollm.state_dict.items()}, torch.float32)
    model = full.first_layers(6)
    compress(model, MagnitudeConfig(pattern="2:4", pack=False), progress=False)
    ids = smollm.tokenizer.encode(read_calibration_text()[:60_000], add_special_tokens=False)
    data = TokenWindows.from_ids(ids, 64, held_out=2)
    cfg = TrainConfig(tokens=64 * 2 * 1 * 4, seq_len=64, batch_size=2, grad_accum=1, lr=2e-4, warmup_steps=0)
    trainer = Trainer(model, data, cfg, SRSTEConfig(pattern="2:4"), progress=False)
    before = trainer.held_out_loss()
    result = trainer.run()
    assert result.held_out[-1][1] < before - 0.1
    assert satisfies_nm(model.model.layers[5].mlp.down_proj.weight, 2, 4)


def test_trained_exit_on_smollm2_lowers_kl_and_drafts_plain_greedy_output(smollm):
    from leanlm.config import EngineConfig
    from leanlm.engine.engine import LLMEngine
    from leanlm.sampling_params import SamplingParams
    from leanlm.train.exits import ExitHeadsConfig, ExitObjective, attach_exits, exit_statistics
    from tests.conftest import run_to_completion

    model = build_model(smollm.config, {k: v.clone() for k, v in smollm.state_dict.items()}, torch.float32)
    exits = ExitHeadsConfig(layers=(24,))
    attach_exits(model, exits)
    ids = smollm.tokenizer.encode(read_calibration_text()[:20_000], add_special_tokens=False)
    data = TokenWindows.from_ids(ids, 64, held_out=2)
    cfg = TrainConfig(tokens=64 * 2 * 3, seq_len=64, batch_size=2, grad_accum=1, lr=2e-2, warmup_steps=0)
    before = exit_statistics(model, data.held_out)[24].mean_kl
    Trainer(model, data, cfg, progress=False, objective=ExitObjective(exits)).run()
    assert exit_statistics(model, data.held_out)[24].mean_kl < before - 0.5
    prompt = smollm.tokenizer.encode("The Eiffel Tower is a wrought-iron lattice tower in Paris. It was built")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for spec in (None, "self:24"):
        engine = LLMEngine(
            model, smollm.tokenizer, EngineConfig.from_options(speculative=spec), torch.device("cpu"), torch.float32
        )
        rid = engine.add_request(prompt, greedy)
        outputs[spec] = run_to_completion(engine)[rid].outputs[0].token_ids
    assert outputs["self:24"] == outputs[None]


def _smollm2_pair(smollm):
    """Teacher: SmolLM2's first 4 layers (real weights, a fraction of the cost); student: 2 of them."""
    from leanlm.train.student import keep_layers

    full = build_model(smollm.config, {k: v.clone() for k, v in smollm.state_dict.items()}, torch.float32)
    teacher = full.first_layers(4)
    ids = smollm.tokenizer.encode(read_calibration_text()[:40_000], add_special_tokens=False)
    data = TokenWindows.from_ids(ids, 64, held_out=2)
    cfg = TrainConfig(tokens=64 * 2 * 4, seq_len=64, batch_size=2, grad_accum=1, lr=5e-4, warmup_steps=0)
    return teacher, keep_layers(teacher, [0, 2]), data, cfg


def test_a_student_cut_from_smollm2_learns_its_teacher(smollm, tmp_path):
    from leanlm.train.distill import DistillConfig, DistillObjective, prepare_teacher

    teacher, student, data, cfg = _smollm2_pair(smollm)
    config = DistillConfig(top_k=16)
    objective = DistillObjective(config, prepare_teacher(teacher, "smol-4", data, cfg, config, tmp_path, False))

    before = teacher_divergence(teacher, student, data.held_out)
    Trainer(student, data, cfg, progress=False, objective=objective).run()
    assert teacher_divergence(teacher, student, data.held_out) < 0.8 * before


def test_the_cosine_term_on_smollm2_pulls_the_students_hidden_states_to_the_teachers(smollm, tmp_path):
    from leanlm.model.forward import hidden_states
    from leanlm.train.distill import DistillConfig, DistillObjective, cosine_distance_sum, prepare_teacher
    from leanlm.train.student import keep_layers

    teacher, _, data, cfg = _smollm2_pair(smollm)

    @torch.no_grad()
    def distance(student):
        ours = hidden_states(student, data.held_out).flatten(0, 1)
        return float(cosine_distance_sum(ours, hidden_states(teacher, data.held_out)))

    after = {}
    for weight in (10.0, 0.0):  # the cosine term beside hard labels, and hard labels alone (the cache serves both)
        config = DistillConfig(top_k=16, kd_weight=0.0, cosine_weight=weight)
        cache = prepare_teacher(teacher, "smol-4", data, cfg, DistillConfig(top_k=16, cosine_weight=10.0), tmp_path)
        student = keep_layers(teacher, [0, 2])
        before = distance(student)
        Trainer(student, data, cfg, progress=False, objective=DistillObjective(config, cache)).run()
        after[weight] = distance(student)
    # 40.0 -> 33.3 with the term, 37.5 without it (Zen 4)
    assert after[10.0] < 0.9 * before and after[10.0] < after[0.0] - 1.0


def test_teal_training_steps_lower_a_smollm2_loss_measured_with_its_inputs_sparse(smollm):
    from leanlm.train.act_sparse import TEALTrainConfig

    full = build_model(smollm.config, {k: v.clone() for k, v in smollm.state_dict.items()}, torch.float32)
    model = full.first_layers(6)
    ids = smollm.tokenizer.encode(read_calibration_text()[:60_000], add_special_tokens=False)
    data = TokenWindows.from_ids(ids, 64, held_out=2)
    cfg = TrainConfig(tokens=64 * 2 * 1 * 4, seq_len=64, batch_size=2, grad_accum=1, lr=2e-4, warmup_steps=0)
    dense_loss = Trainer(model, data, cfg, progress=False).held_out_loss()
    trainer = Trainer(model, data, cfg, TEALTrainConfig(sparsity=0.5), progress=False)
    before = trainer.held_out_loss()  # the hooks are on: half of every linear's inputs zero
    assert abs(before - dense_loss) > 0.1  # (6 of 30 layers under the real head: the loss itself means little)
    result = trainer.run()
    assert result.held_out[-1][1] < before - 0.1
    assert result.sparsity == {"input sparsity": 0.5}
    assert not any(m._forward_pre_hooks for m in model.modules())  # decode's layers come from compress, not hooks

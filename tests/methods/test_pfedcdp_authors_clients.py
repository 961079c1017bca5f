"""Issue 63 (items 2-3, PFedCDP): preset ``authors_v1_7`` trains and scores as the authors' v1.7
client files do (shadhin39/PFedCDP, PFedCDP/v1.7/PFedCDP/client.py, client1.py, client2.py), and
every value a PFedCDP preset takes from the authors' code cites its file and line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from medfl.config import build_method
from medfl.engine.client import run_client_update
from medfl.messages import Instruction
from medfl.method import MethodConfigError
from medfl_plugins.pfedcdp import losses, method
from medfl_plugins.pfedcdp import PRESETS, PFedCDP

from test_pfedcdp import SCORES_BY_CLIENT, _run

# clients "0" high (model A), "1" and "2" medium (B), "3" low (C)
HIGH, MEDIUM, LOW = "0", "1", "3"


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Record every call of the plugin's ``name`` (kd_loss in its losses, make_optimizer in its
    method), passing it through."""
    calls: list[Any] = []
    module = losses if name == "kd_loss" else method
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _round1(tmp_path: Path, cid: str, spy: Any = None, **method: Any) -> tuple[Any, Any, Any]:
    """Client ``cid``'s round-1 update (``spy()`` called just before it, after the coordinator's setup)."""
    run = _run(tmp_path, capabilities=SCORES_BY_CLIENT, feature_shap="off", **method)
    ins = run.coordinator.configure_round(1)
    ctx = run.context(cid, 1)
    if spy is not None:
        spy()
    reply = run_client_update(run.client_method, ctx, ins[cid], filters=run.privacy.chain)
    return run, ctx, reply


@pytest.mark.parametrize("cid", [MEDIUM, LOW])
def test_v1_7_models_b_and_c_train_on_cross_entropy_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          cid: str) -> None:
    """client1.py / client2.py ``fit`` never calls ``download_teacher_model``: no teacher, no eq. 11."""
    built: list[str] = []
    real_build = method.build_seeded

    def spies() -> None:
        calls.append(_spy(monkeypatch, "kd_loss"))
        monkeypatch.setattr(method, "build_seeded", lambda spec, *a, **k: built.append(spec["name"]) or real_build(
            spec, *a, **k))

    calls: list[list[Any]] = []
    _, _, reply = _round1(tmp_path, cid, spies, preset="authors_v1_7")
    kd = calls[0]
    assert kd == []                                              # no distillation term, ever
    assert len(built) == 1                                       # the client's own model; no teacher built
    assert reply.metrics["steps"] > 0


def test_v1_7_model_a_distils_with_its_softmax_outputs_soft_maxed_again(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """client.py: model A's classifier ends in a softmax (line 158) and compute_distillation_loss
    soft-maxes the outputs again (lines 522-523, 530): eq. 11 receives probabilities."""
    calls: list[list[Any]] = []
    _round1(tmp_path, HIGH, lambda: calls.append(_spy(monkeypatch, "kd_loss")), preset="authors_v1_7")
    kd = calls[0]
    assert kd
    for (student, teacher, _y), _ in kd:
        for out in (student, teacher):
            assert bool((out >= 0).all()) and torch.allclose(out.sum(dim=1), torch.ones(len(out)), atol=1e-5)


def test_probabilities_input_is_eq_11_applied_to_softmax_outputs() -> None:
    z_s, z_t, y = torch.randn(6, 3), torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    p_s, p_t = torch.softmax(z_s, 1), torch.softmax(z_t, 1)
    lam, temp = 0.3, 3.0
    ce = -torch.log_softmax(p_s, 1)[torch.arange(6), y].mean()           # CE of softmax(p_s)
    q_t, log_q_s = torch.softmax(p_t / temp, 1), torch.log_softmax(p_s / temp, 1)
    kl = (q_t * (torch.log(q_t) - log_q_s)).sum(1).mean()
    want = (1 - lam) * ce + lam * temp ** 2 * kl
    assert float(losses.kd_loss(p_s, p_t, y, lam=lam, temperature=temp)) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("cid, lr", [(LOW, 3e-4), (MEDIUM, None), (HIGH, None)])
def test_v1_7_model_c_trains_at_3e_4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cid: str,
                                     lr: float | None) -> None:
    """client2.py, line 888: model C compiles Adam(learning_rate=0.0003); A and B keep train.lr."""
    calls: list[list[Any]] = []
    _, ctx, _ = _round1(tmp_path, cid, lambda: calls.append(_spy(monkeypatch, "make_optimizer")),
                        preset="authors_v1_7")
    opts = calls[0]
    got = [args[1]["lr"] for args, _ in opts]
    assert got and set(got) == {lr if lr is not None else ctx.train["lr"]}
    for opt_args, _ in opts:
        assert opt_args[1]["optimizer"] == "adam"


def test_v1_7_scores_the_aggregated_extractor_with_each_clients_classifier(tmp_path: Path) -> None:
    """FlowerClient.evaluate: set_feature_extractor_weights(parameters), then the full model:
    the cluster's aggregated extractor with the client's own classifier; 'personal' differs."""
    run = _run(tmp_path, capabilities=SCORES_BY_CLIENT, feature_shap="off", preset="authors_v1_7")
    m = run.coordinator
    assert m.score == "global" and m.report()["scoring"]["score"] == "global"
    ins = m.configure_round(1)
    ctxs = {cid: run.context(cid, 1) for cid in ins}
    replies = {cid: run_client_update(run.client_method, ctxs[cid], ins[cid], filters=run.privacy.chain)
               for cid in ins}
    m.server_update(1, replies)
    evals = m.configure_evaluate(1)
    ctx = ctxs[MEDIUM]
    ev = evals[MEDIUM]
    assert ev.config["score"] == "global" and "extractor" in ev.payload    # every client gets its cluster model
    model = run.client_method.client_eval_model(ctx, ev)
    state = model.state_dict()
    for k, v in m.extractors["medium"].items():
        assert torch.equal(state[k].cpu(), v.cpu()), k                     # the aggregated (noised) extractor
    for k, v in ctx.state["head"].items():
        assert torch.equal(state[k].cpu(), v.cpu()), k                     # the client's own classifier
    personal = run.client_method.client_eval_model(
        ctx, Instruction(payload=ev.payload, config={**ev.config, "score": "personal"}))
    pstate = personal.state_dict()
    assert all(torch.equal(pstate[k].cpu(), v.cpu()) for k, v in ctx.state["extractor"].items())
    assert any(not torch.equal(pstate[k], state[k]) for k in m.extractors["medium"])


def test_scoring_is_an_option_of_every_preset_and_recorded() -> None:
    for name in PRESETS:
        m = build_method({"name": "pfedcdp", "preset": name})
        assert m.hparams()["score"] == m.score == ("global" if name.startswith("authors") and name != "authors_formula"
                                                   else "personal")
        assert PRESETS[name].source_of("score")[0] in ("paper", "authors_code", "reading", "open")
    m = build_method({"name": "pfedcdp", "preset": "paper", "score": "global"})
    assert m.score == "global" and m.configure_evaluate.__doc__
    with pytest.raises(MethodConfigError, match="score must be one of personal, global"):
        PFedCDP(score="own")
    with pytest.raises(MethodConfigError, match="kd_clusters"):
        PFedCDP(kd_clusters=["mid"])
    with pytest.raises(MethodConfigError, match="cluster_lr"):
        PFedCDP(cluster_lr={"low": -1.0})
    with pytest.raises(MethodConfigError, match="kd_input"):
        PFedCDP(kd_input="softmax")


def test_v1_7_preset_values() -> None:
    m = build_method({"name": "pfedcdp", "preset": "authors_v1_7"})
    assert (m.kd_clusters, m.kd_input, m.score) == (["high"], "probabilities", "global")
    assert m.cluster_lr == {"high": None, "medium": None, "low": 3e-4}
    assert m.client_train("low", {"lr": 1e-3, "optimizer": "adam"}) == {"lr": 3e-4, "optimizer": "adam"}
    assert m.client_train("medium", {"lr": 1e-3}) == {"lr": 1e-3}
    paper = build_method({"name": "pfedcdp", "preset": "paper"})
    assert (paper.kd_clusters, paper.kd_input, paper.cluster_lr) == (["high", "medium", "low"], "logits", None)


def test_scored_from_global_counts_the_noised_round_itself() -> None:
    m = PFedCDP(epsilon=None, noise_multiplier=0.6, dp_mode="weights_per_tensor", dp_clusters=["medium"],
                quantize="weights", score="global")
    m.assign, m.first_noised_round = {"0": "high", "1": "medium"}, None
    assert m.scored_from(1) is None
    m.first_noised_round = 1
    assert (m.scored_from(1), m.scored_from(3)) == (1, 1)


_LINE = re.compile(r"\blines? \d+")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_authors_code_source_cites_a_line(name: str) -> None:
    preset = PRESETS[name]
    for key in preset.entries():
        kind, citation = preset.source_of(key)
        if kind == "authors_code":
            assert _LINE.search(citation), (name, key, citation)
        assert "not re-read" not in citation, (name, key)


def test_relabelled_values() -> None:
    """Issue 63: the values whose label did not hold."""
    v17 = PRESETS["authors_v1_7"]
    kind, cite = v17.source_of("kd_scope")
    assert kind == "authors_code" and "lines 298-299" in cite and "cross-entropy alone" in cite
    assert v17.source_of("cluster_lr")[0] == "authors_code" and "line 888" in v17.source_of("cluster_lr")[1]
    assert v17.source_of("teacher_weights") == ("authors_code", v17.source_of("teacher_weights")[1])
    assert "line 218" in v17.source_of("teacher_weights")[1]
    paper = PRESETS["paper"]
    kind, cite = paper.source_of("cluster_models")
    assert kind == "reading" and "no rate given" in cite and "line 722" in cite
    kind, cite = paper.source_of("train.lr")
    assert kind == "reading" and "3e-4" in cite

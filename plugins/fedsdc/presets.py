"""FedSDC's presets, each value cited: the paper's settings (paper 002, sec. 2.2 and 3.3) and
the authors' code (github.com/wpnine/FedSDC at commit 3e2cc00, by file and line)."""

from __future__ import annotations

from typing import Any

from medfl.method import Preset

from .models import PAPER_EMBED_DIM

__all__ = ["PRESETS"]

_PAPER = {"beta": 0.5, "server_lr": 1.0, "rho_min": 0.4, "rho_max": 1.0, "diversity": True, "shuffle": True,
          "vote": "majority", "head": "mlp", "dropout": 0.2, "head_activation": "relu",
          "tie_break": "mean_probability", "rho_sampling": "uniform", "min_hidden": PAPER_EMBED_DIM}
_SDC = "wpnine/FedSDC (commit 3e2cc00)"
_TOML = f"{_SDC}, pyproject.toml"
_SEC22 = "sec. 2.2"
_PAPER_SOURCES = {
    "beta": f"paper: {_SEC22}, eq. 4 ('the momentum parameter, which is empirically set to 0.5')",
    "server_lr": f"paper: {_SEC22}, eq. 5 (phi^(t+1) = phi^t - v^t: the server step is the momentum itself)",
    "rho_min": f"paper: {_SEC22} ('a client-specific compression factor rho_i in [0.4, 1]')",
    "rho_max": f"paper: {_SEC22} ('a client-specific compression factor rho_i in [0.4, 1]')",
    "diversity": f"paper: {_SEC22} (the Diversity mechanism) and Table 2 (FedSDC = Diversity + Shuffle)",
    "shuffle": f"paper: {_SEC22}, eq. 6 (Shuffle) and Table 2 (FedSDC = Diversity + Shuffle)",
    "vote": f"reading: {_SEC22}, 'head-specific class probabilities p_i = Softmax(...); these predictions are "
            "aggregated via major voting', read as a vote of each head's top class; other reading: soft voting, the "
            "mean of the p_i (vote 'mean'), which the softmax before the vote would suggest",
    "head": f"paper: {_SEC22} ('a two-layer fully connected (FC) network, where a dropout layer is inserted between "
            "the linear layers')",
    "dropout": f"authors_code: {_TOML}, line 83 (sdc_head_dropout = 0.2); the paper gives no rate",
    "head_activation": f"reading: {_SEC22}, 'a two-layer fully connected (FC) network, where a dropout layer is "
                       "inserted between the linear layers', read as an MLP (ReLU after the first layer); other "
                       f"reading: no activation, an affine head at test time, as {_SDC}, fedsdc/fedsdc_model.py, "
                       "lines 155-158 (preset 'authors': head_activation 'none')",
    "tie_break": "open: the paper says 'major voting' and nothing of ties; medfl gives a tie to the tied class of "
                 "highest mean probability (the authors' code: the argmax of the summed logits, preset 'authors')",
    "rho_sampling": f"open: {_SEC22} gives the range [0.4, 1] and no distribution; independent uniform draws per head "
                    f"(the authors' code draws one per stratum of the range, {_SDC}, server_app.py, lines 38-44: "
                    "preset 'authors')",
    "min_hidden": f"reading: {_SEC22}, 'the shared body phi employs a ResNet50 backbone' and 'the dimensionality of "
                  "the first FC layer in h_i is dynamically adjusted via a client-specific compression factor "
                  "rho_i', read as rho x 2048 units (the paper's ResNet-50 embedding) on any body; other reading: "
                  f"rho x the body's own embedding (min_hidden None, as the authors' code, {_SDC}, "
                  "fedsdc/fedsdc_model.py, line 154), which gives a small body heads of a few units (issue 37)",
    "train.optimizer": "paper: sec. 3.3 ('we set the optimizer to SGD')",
    "train.momentum": "reading: sec. 2.2, 'Using Stochastic Gradient Descend (SGD) with learning rate eta', and sec. "
                      "3.3, 'we set the optimizer to SGD', read as plain SGD (momentum 0); other reading: SGD with a "
                      f"momentum the paper does not give (the authors' code: 0.01, {_TOML}, line 98, preset "
                      "'authors')",
    "train.weight_decay": f"open: not stated; none (the authors' code: 1e-3, {_TOML}, line 104)",
    "train.epochs": f"open: local epochs are not stated; one per round (the authors' code runs 5, {_TOML}, line 95: "
                    "preset 'authors')",
    "gamma": f"reading: {_SEC22}, 'retaining only the top gamma in [0, 1] fraction (e.g., gamma = 0.3 prunes 70% "
             "under-performing heads)', read as FedSDC+'s gamma in Table 1; other reading: 0.3 is only an example "
             f"and Table 1's gamma is not stated (the authors' code uses 0.3, {_SDC}, run_for_sparse.py, line 203)",
    "keep_rounding": f"authors_code: {_SDC}, run_for_sparse.py, line 205 (math.ceil(gamma * head_cnt)); the paper "
                     "keeps 'the top gamma fraction' without rounding",
}
_NIID1_SOURCES = {"train.lr": "paper: sec. 3.3 ('For the NIID-1, the learning rate is set to 1e-3')",
                  "train.batch_size": "paper: sec. 3.3 (NIID-1: 'trained with a batch size of 64')"}
_NIID2_SOURCES = {"train.lr": "paper: sec. 3.3 ('for the IID and NIID-2, we set the optimizer to SGD with a learning "
                              "rate of 1e-4')",
                  "train.batch_size": "paper: sec. 3.3 (IID and NIID-2: 'the batch size is set to 32')"}
_MODEL, _CLIENT = f"{_SDC}, fedsdc/fedsdc_model.py", f"{_SDC}, fedsdc/fedsdc_client.py"
_AUTHORS_SOURCES = {
    "beta": f"authors_code: {_TOML}, line 44 (server_momentum_beta = 0.5), passed to FedAvgM in "
            "fedsdc/fedsdc_strategy.py, line 143",
    "server_lr": f"authors_code: {_SDC}, fedsdc/fedsdc_strategy.py, lines 136-145 (FedAvgM built without "
                 "server_learning_rate: Flower's default 1.0)",
    "rho_min": f"authors_code: {_TOML}, line 77 (sdc_rho_start = 0.4)",
    "rho_max": f"authors_code: {_TOML}, line 80 (sdc_rho_end = 1.0)",
    "diversity": f"authors_code: {_TOML}, line 74 (sdc_diverse_head = 1)",
    "shuffle": f"authors_code: {_TOML}, line 71 (sdc_shuffle = 1)",
    "vote": f"authors_code: {_CLIENT}, lines 171-209 (each head's top-1 class counts 1.0; the most counted wins)",
    "head": f"authors_code: {_MODEL}, lines 154-159 (Linear, Dropout, Linear)",
    "dropout": f"authors_code: {_TOML}, line 83 (sdc_head_dropout = 0.2)",
    "head_activation": f"authors_code: {_MODEL}, lines 155-158 (no activation between the two Linear layers)",
    "tie_break": f"authors_code: {_CLIENT}, lines 187-209 (a tied vote keeps the argmax of the summed logits)",
    "rho_sampling": f"authors_code: {_SDC}, server_app.py, lines 38-44 (one uniform draw in each of head_cnt equal "
                    "strata of [rho_start, rho_end])",
    "min_hidden": f"authors_code: {_MODEL}, line 154 (int(rho x body.n_outputs): rho scales the body's own embedding)",
    "gamma": f"authors_code: {_SDC}, run_for_sparse.py, line 203 (gamma = 0.3)",
    "keep_rounding": f"authors_code: {_SDC}, run_for_sparse.py, line 205 (math.ceil(gamma * head_cnt))",
    "train.optimizer": f"authors_code: {_MODEL}, lines 74-79 (torch.optim.SGD)",
    "train.lr": f"authors_code: {_TOML}, line 101 (local_lr = 1e-3)",
    "train.batch_size": f"authors_code: {_TOML}, line 107 (local_batch_size = 64)",
    "train.momentum": f"authors_code: {_TOML}, line 98 (local_momentum = 1e-2)",
    "train.weight_decay": f"authors_code: {_TOML}, line 104 (local_wd = 0.001)",
    "train.epochs": f"authors_code: {_TOML}, line 95 (local_epoch = 5)",
}
_NIID1 = {"optimizer": "sgd", "lr": 1e-3, "batch_size": 64, "momentum": 0.0, "weight_decay": 0.0, "epochs": 1}
_NIID2 = {**_NIID1, "lr": 1e-4, "batch_size": 32}
_EXP1 = {"rounds": 1500, "early_stopping": "yes (rule not stated)", "global_test_per_class": 30,
         "partition": {"name": "dirichlet", "alpha": 5.0}, "dataset": "HAM10000 (NIID-1)",
         "num_clients": "not stated for NIID-1", "model": "resnet50 body (2048-d embedding)",
         "metric": "micro_f1", "seeds": 5}
_EXP2 = {"rounds": 1500, "early_stopping": "yes (rule not stated)", "num_clients": 15,
         "partition": "class_sample: each client 5-6 classes, 20-60 images each; the rest is the test set",
         "dataset": "Matek-19, Acevedo-20, Bodzas-23 (NIID-2; IID: Acevedo-20, 80/20)",
         "model": "resnet50 body (2048-d embedding)", "metric": "micro_f1", "seeds": 5}
_AUTHORS = {**_PAPER, "head_activation": "none", "tie_break": "logit_sum", "rho_sampling": "stratified",
            "min_hidden": None}   # int(rho x the body's n_outputs): 819-2048 on their ResNet-50
_EXP_AUTHORS = {"rounds": 1500, "num_clients": 15, "fraction": 0.67,
                "heads": "int(15 x 0.67) = 10 heads, one per sampled client (medfl: one head per client)",
                "early_stopping": "off (server_early_stopping_step 0); the round of best test accuracy is kept",
                "model": "resnet50 ImageNet-pretrained, BatchNorm frozen, dropout 0.1 on the embedding",
                "image_size": 56, "augment": "flips, rotation 20, color jitter 0.1",
                "sparse_ranking": "FedSDC+ ranks heads by balanced accuracy on the pooled training sets "
                                  "(run_for_sparse.py, line 211, evaluate='bacc'; macro-F1 before commit 3e2cc00), "
                                  "not micro-F1 on validation data (not reproduced in medfl)"}
_SRC = "Gao et al., FedSDC (paper 002), sec. 2.2 (eqs. 4-8, rho, dropout, voting, gamma) and sec. 3.3"
_ASRC = ("the authors' code, github.com/wpnine/FedSDC at commit 3e2cc00 (pyproject.toml, server_app.py, "
         "fedsdc/*.py, run_for_sparse.py)")


def _preset(values: dict[str, Any], train: dict[str, Any], sources: dict[str, str], exp: dict[str, Any],
            source: str, text: str, plus: bool) -> Preset:
    """One preset: ``values`` (with FedSDC+'s gamma 0.3 when ``plus``) and ``train``, each
    entry with its citation from ``sources``."""
    v = {**values, "gamma": 0.3, "keep_rounding": "ceil"} if plus else dict(values)
    keys = {*v, *(f"train.{k}" for k in train)}
    return Preset(source=source, values=v, train=dict(train), experiment=dict(exp),
                  sources={k: cite for k, cite in sources.items() if k in keys},
                  description=text + (" + FedSDC+ (gamma 0.3)" if plus else ""))


#: preset name: the arguments of :func:`_preset` but ``plus``
_SETTINGS: dict[str, tuple[Any, ...]] = {
    "paper": (_PAPER, _NIID1, {**_PAPER_SOURCES, **_NIID1_SOURCES}, _EXP1,
              _SRC + " (NIID-1: lr 1e-3, batch 64)", "the paper's settings, NIID-1 (HAM10000)"),
    "paper_niid2": (_PAPER, _NIID2, {**_PAPER_SOURCES, **_NIID2_SOURCES}, _EXP2,
                    _SRC + " (IID and NIID-2: lr 1e-4, batch 32)",
                    "the paper's settings, IID / NIID-2 (blood-cell datasets)"),
    "authors": (_AUTHORS, {**_NIID1, "momentum": 0.01, "weight_decay": 1e-3, "epochs": 5}, _AUTHORS_SOURCES,
                _EXP_AUTHORS, _ASRC, "the authors' published code (HAM10000 NIID-1 settings)"),
}
#: FedSDC's presets: each setting as FedSDC and (``_plus``) as FedSDC+ with gamma 0.3
PRESETS: dict[str, Preset] = {name + plus: _preset(*args, plus=bool(plus))
                              for name, args in _SETTINGS.items() for plus in ("", "_plus")}

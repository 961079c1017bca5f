"""Bad local-training settings stop before anything is written (issue 19), with one message
naming the key; a run whose training diverges stops naming the client and round, and its
status says "failed"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medfl.cli import main
from medfl.config import ConfigError, resolve_config
from medfl.experiment import run_experiment
from medfl.training import NonFiniteError


@pytest.mark.parametrize("change, message", [
    ({"train": {"lr": -0.5}}, r"fl.train.lr: expected a positive learning rate, got -0.5"),
    ({"train": {"lr": "fast"}}, r"fl.train.lr: expected a finite number, got 'fast'"),
    ({"train": {"batch_size": 0}}, r"fl.train.batch_size: expected an integer >= 1, got 0"),
    ({"train": {"epochs": -1}}, r"fl.train.epochs: expected an integer >= 1, got -1"),
    ({"train": {"optimizer": "lbfgs"}}, r"fl.train.optimizer: unknown optimizer 'lbfgs'; valid: sgd, adam, adamw"),
    ({"train": {"momentum": 1.5}}, r"fl.train.momentum: expected a number in \[0, 1\)"),
    ({"num_clients": 0}, r"fl.num_clients: expected at least 1, got 0"),
    ({"device": "gpu7"}, r"fl.device: 'gpu7' is not a device"),
    ({"methods": [{"name": "fedavg", "train": {"lr": 0}}]}, r"fl.methods\[0\] \(fedavg\).train.lr: expected a positive"),
    # issue 39, item 9: these were a TypeError traceback from the plugin, or accepted silently
    ({"dataset": {"name": "synthetic2d", "bogus": 1}}, r"fl.dataset: dataset 'synthetic2d' takes no parameter\(s\) "
                                                        r"'bogus'; valid: root, num_samples"),
    ({"partition": {"name": "dirichlet", "alpha": 1.0, "bogus": 1}},
     r"fl.partition: partitioner 'dirichlet' takes no parameter\(s\) 'bogus'; valid: .*alpha"),
    ({"model": {"name": "small_cnn", "bogus": 1}}, r"fl.model: model 'small_cnn' takes no parameter\(s\) 'bogus'"),
    ({"keep_checkpoints": 0}, r"fl.keep_checkpoints: expected at least 1 .*got 0"),
    # issue 39, item 9: a RuntimeError from a convolution (image_size 0), or a ValueError traceback
    # from the plugin, after the run directory was made
    ({"dataset": {"name": "synthetic2d", "image_size": 0}},
     r"^fl.dataset.image_size: expected a positive integer \(a size or count\), got 0$"),
    ({"dataset": {"name": "synthetic2d", "image_size": -8}}, r"fl.dataset.image_size: .* got -8"),
    ({"dataset": {"name": "synthetic2d", "image_size": 12.5}}, r"fl.dataset.image_size: .* got 12.5"),
    ({"dataset": {"name": "synthetic2d", "image_size": "12"}}, r"fl.dataset.image_size: .* got '12'"),
    ({"dataset": {"name": "synthetic2d", "num_samples": 0}}, r"fl.dataset.num_samples: expected a positive integer"),
    ({"dataset": {"name": "random_blocks", "image_size": 0}}, r"fl.dataset.image_size: expected a positive integer"),
    ({"dataset": {"name": "manifest", "path": "m.csv", "spatial_size": [32, 0]}},
     r"fl.dataset.spatial_size: expected a non-empty list of positive integers or null \(a size or count\), "
     r"got \[32, 0\]"),
    ({"model": {"name": "small_cnn", "width": 0}}, r"fl.model.width: expected a positive integer"),
    ({"model": {"name": "resnet10", "width": 4, "bogus": 1}},
     r"fl.model: model 'resnet10' takes no parameter\(s\) 'bogus'; valid: .*no_max_pool"),
    ({"model": {"name": "resnet10", "width": 4}, "client_models": [{"width": 4}, {"width": 0}, {"width": 2}]},
     r"fl.client_models.1.width: expected a positive integer"),
])
def test_bad_settings_are_refused_by_name(tiny_fl, change, message) -> None:
    fl = dict(tiny_fl)
    for k, v in change.items():
        fl[k] = {**fl.get(k, {}), **v} if k == "train" else v
    with pytest.raises(ConfigError, match=message):
        resolve_config(fl)


def test_a_bad_image_size_stops_before_any_directory(tiny_fl, tmp_path, capsys) -> None:
    """Issue 39, item 9: ``dataset.image_size=0`` was a RuntimeError from a convolution, with the
    run directory made; now one ``medfl: error:`` line and nothing written."""
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": {**tiny_fl, "dataset": {**tiny_fl["dataset"], "image_size": 0}}}))
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "medfl: error: fl.dataset.image_size: expected a positive integer" in err and "Traceback" not in err
    assert not Path(tiny_fl["output_dir"]).exists() and not (tmp_path / "data").exists()


def test_an_output_dir_that_is_a_file_is_refused_by_name(tiny_fl, tmp_path) -> None:
    """Issue 39, item 9: an ``output_dir`` that is a file gave FileExistsError."""
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ConfigError, match=r"fl.output_dir: '.*afile' is a file; expected a directory"):
        resolve_config({**tiny_fl, "output_dir": str(tmp_path / "afile")})
    assert (tmp_path / "afile").read_text() == "mine"


def test_nothing_is_written_for_a_device_or_partition_that_cannot_work(tiny_fl, tmp_path, capsys) -> None:
    out = Path(tiny_fl["output_dir"])
    for change, message in (({"device": "cuda:7"}, "fl.device: 'cuda:7' but this machine has"),
                            ({"num_clients": 500}, "num_clients=500 is more than the number of rows")):
        cfg = tmp_path / "train.json"
        cfg.write_text(json.dumps({"fl": {**tiny_fl, **change}}))
        assert main(["run", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert not (out / "t").exists()


def test_a_diverging_run_stops_naming_client_and_round(tiny_fl) -> None:
    fl = dict(tiny_fl, train={**tiny_fl["train"], "lr": 1e8}, rounds=3)
    with pytest.raises(NonFiniteError, match=r"client \d, round \d: "):
        run_experiment(resolve_config(fl))
    status = json.loads((Path(tiny_fl["output_dir"]) / "t" / "fedavg" / "status.json").read_text())
    assert status["status"] == "failed"


def test_the_advice_of_a_diverging_run_can_be_followed(tiny_fl, tmp_path, capsys) -> None:
    """Issue 39, item 7: at lr 1e8 the error advises "set train.clip_grad_norm", but
    ``fl#train#clip_grad_norm=1.0`` was refused as an unknown key. It is taken from the config
    and from the command line, checked, and reaches the clients' training."""
    fl = dict(tiny_fl, rounds=1)
    cfg = resolve_config({**fl, "train": {**fl["train"], "clip_grad_norm": 1.0}})
    assert cfg["train"]["clip_grad_norm"] == 1.0
    with pytest.raises(ConfigError, match=r"fl.train.clip_grad_norm: expected null or a positive number, got 0"):
        resolve_config({**fl, "train": {**fl["train"], "clip_grad_norm": 0}})
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"fl": fl}))
    assert main(["run", str(path), "--fl#train#clip_grad_norm", "1.0"]) == 0, capsys.readouterr().err
    saved = json.loads((Path(tiny_fl["output_dir"]) / "t" / "config.json").read_text())
    assert saved["fl"]["train"]["clip_grad_norm"] == 1.0


def test_a_diverging_fedbn_stops_at_the_client_with_the_same_error(tiny_fl) -> None:
    """Issue 39, item 8: FedBN's reply is finite while its norm layers, kept at the client,
    are not; the run died in evaluation with ``ValueError: probs must be finite``. The client
    checks its whole local model (the layers it keeps too) and stops the run as FedAvg's
    does: naming the client, the round and the tensor, and the advice."""
    fl = dict(tiny_fl, train={**tiny_fl["train"], "lr": 1e8}, rounds=3, methods=[{"name": "fedbn"}])
    with pytest.raises(NonFiniteError, match=r"client \d, round 1: the client's own state\['local'\]\[.*\] holds "
                                             r"NaN or infinite values \(training diverged\); lower train.lr"):
        run_experiment(resolve_config(fl))
    status = json.loads((Path(tiny_fl["output_dir"]) / "t" / "fedbn" / "status.json").read_text())
    assert status["status"] == "failed"


def test_a_run_whose_loss_explodes_finishes_with_a_warning(tiny_fl, capsys) -> None:
    """Issue 39, item 8: at lr 100 FedAvg's training loss is 500 to 3e10 (ln 2 = 0.69 for a
    model that predicts uniformly), every value finite, and the run finished with no word.
    It finishes, says on stderr that training diverges, and keeps the warning in
    summary.json; an honest run of the same job gets none."""
    fl = dict(tiny_fl, train={**tiny_fl["train"], "lr": 100.0}, rounds=2)
    out = run_experiment(resolve_config(fl))
    err = capsys.readouterr().err
    assert "round 1: warning: training is diverging: the mean training loss of round 1 is" in err
    warnings = json.loads((Path(out["dir"]) / "fedavg" / "summary.json").read_text())["warnings"]
    assert [w["round"] for w in warnings] == [1] and "lower train.lr" in warnings[0]["warning"]
    honest = run_experiment(resolve_config(dict(tiny_fl, name="honest", rounds=2)))
    assert "warnings" not in json.loads((Path(honest["dir"]) / "fedavg" / "summary.json").read_text())
    assert "diverging" not in capsys.readouterr().err

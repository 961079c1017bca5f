"""Every key of a bundle's ``fl`` section with its default (:data:`DEFAULTS`), and the keys
that are valid but absent unless set (:data:`TRAIN_OPTIONAL`, :data:`FL_OPTIONAL`)."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "TRAIN_OPTIONAL", "FL_OPTIONAL"]


#: Every valid key of the ``fl`` section with its default. ``dataset``, ``partition``,
#: ``model`` and each entry of ``methods`` are ``{"name": ..., **plugin parameters}``.
DEFAULTS: dict[str, Any] = {
    "name": "run",                  # experiment name: the run directory is output_dir/name
    "output_dir": "runs",
    "seed": 0,
    "rounds": 5,
    "stop_after_round": None,       # stop early (as if killed); `medfl resume` continues
    "num_clients": 4,
    "fraction": 1.0,                # fraction of clients sampled each round
    "device": "cpu",
    "dataset": {"name": "synthetic2d"},
    "global_test_fraction": 0.2,    # held-out global test when the data has no `split` column
    "global_test_per_class": None,  # or k: hold out k rows of every class instead (FedSDC's NIID-1: 30)
    "use_official_split": True,     # False: ignore the dataset's `split` column (its test rows join the pool)
    # rows sharing it (one patient's images) go to one client (every built-in partitioner deals
    # whole groups) and never straddle the global test or a client's train/val/test splits;
    # null: rows one by one (partition_report.json counts the subjects that then straddle)
    "group_column": "subject_id",
    # a dataset only the coordinator reads (never a client), e.g. MIAS as the public/proxy set
    # that knowledge-distillation methods distil into: null, or {"name": <dataset plugin>,
    # **its parameters} plus the reserved keys "test_fraction" (0.15: the test share drawn by
    # group when there is no official split), "use_official_split" and "group_column" (both
    # default to the run's); see medfl.public
    "public_dataset": None,
    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 10},
    "client_split": {"train": 0.7, "val": 0.15, "test": 0.15},
    # k-fold cross-validation: folds > 1 runs every method once per fold (fold_<k>/), each
    # client's test split being its k-th fold (from `column` when the dataset has one) and
    # the rest split train:val in client_split's ratio; `metric` is the one cv_table reports
    "cv": {"folds": 0, "column": None, "metric": "auc"},
    # repeat the whole experiment once per seed (seed_<s>/: split, initialisation and
    # training order all follow the seed) and report mean ± std over seeds: e.g. [0, 1, 2, 3, 4]
    "seeds": None,
    "model": {"name": "resnet10", "width": 16},
    "client_models": {},            # per-client model overrides {client_id: {kwarg: value}}, or a list in id order
    "train": {
        "epochs": 1,
        "batch_size": 16,
        "eval_batch_size": 64,
        "lr": 0.01,
        "optimizer": "sgd",
        "momentum": 0.9,
        "weight_decay": 0.0,
        "num_workers": 0,
        # DP-SGD in local training (Opacus): {"epsilon": 3 | "noise_multiplier": 1.1,
        # "max_grad_norm": 1.0, "delta": 1e-5, "accountant": "rdp"}; null: off
        "dp": None,
    },
    # reply filters applied to every method's model state (a method entry's own "filters"
    # replaces this list): e.g. [{"name": "dp_gaussian", "epsilon": 3, "clip": 1.0},
    # {"name": "quantize", "bits": 8}]; `medfl plugins` lists them
    "filters": [],
    "methods": [{"name": "fedavg"}],
    "eval_splits": ["test", "global_test"],  # + "cross_test": each model on every client's test split
    "eval_every": 1,                # evaluate every k rounds (the last round always; 0: last only)
    # early stopping and best-round selection for every method: null (off: every round runs
    # and the last round's models are final), or {"metric": "val/micro_f1", "patience": 5,
    # "min_delta": 0.0, "mode": null, "min_rounds": 0} (EARLY_STOPPING_DEFAULTS): after each
    # evaluated round the mean over clients of <split>/<metric> (a split of eval_splits, a
    # column of metrics.csv); a round that beats the best by more than min_delta becomes the
    # best round, and the run stops once `patience` evaluated rounds (eval_every) in a row did
    # not (and at least min_rounds ran); the best round's models are final (summary.json,
    # final_models, predict). mode null: "min" for a lower-is-better metric, else "max".
    # Selecting on a test split is allowed but is test-set leakage (warned, recorded)
    "early_stopping": None,
    "keep_checkpoints": 2,
    "max_reply_failures": 3,        # a client whose replies fail the coordinator's checks this often is excluded (0: never)
    # a reply whose update (model state minus the state sent) is longer than this many times
    # the median update norm of its training step is dropped (reply_events.csv, counted toward
    # max_reply_failures), as robust aggregators bound updates; >= 2, or 0: off
    "update_norm_factor": 10.0,
    # the fewest sites whose answers a round's training and evaluation need (as Flower's
    # min_available_clients): the larger of min_sites and min_fraction (null: unused) of the
    # sites a round addresses, never more than it addresses. Over Flower a round with fewer
    # sites available waits up to site_wait_s seconds for them (lost sites are asked for
    # their hello again); a round with fewer answers fails the run (status "failed", resumable)
    "min_sites": 1,
    "min_fraction": None,
    "site_wait_s": 300.0,
    "progress": True,
    # where the clients run: "inprocess" (one after another in this process) or "ray"
    # (Flower's simulation runtime: clients in parallel Ray actors, through the same
    # ServerApp/ClientApp code as a deployment; needs `pip install "medfl[simulation]"`),
    # e.g. {"name": "ray", "client_cpus": 1, "client_gpus": 0.5} (see BACKEND_DEFAULTS)
    "backend": "inprocess",
    "overwrite": False,             # False: a new directory name-2, name-3... if name exists
}

#: Keys of ``train`` that are valid but absent unless set (they change how a client computes,
#: not what it learns, so configs without them send the same messages as before):
#: ``amp`` mixed precision ("bf16" or "fp16", with a gradient scaler; :mod:`medfl.training`),
#: ``channels_last`` (channels-last memory format for 2D/3D convolutions), ``pin_memory``
#: (page-locked batches; null: on for CUDA devices), ``clip_grad_norm`` (the global gradient
#: norm each step is clipped to, :func:`check_train`; null: no clipping).
TRAIN_OPTIONAL: dict[str, Any] = {"amp": None, "channels_last": False, "pin_memory": None, "clip_grad_norm": None}

#: Top-level keys that are valid but absent unless set: ``plots`` (``false``: no PNG plots at the
#: end of runs and experiments, the CSV/JSON results are written all the same and ``medfl
#: report RUN_DIR`` draws the plots later; the environment variable ``MEDFL_NO_PLOTS=1`` does
#: the same for every run of a process and its children, :func:`medfl.plotting.plots_wanted`).
#: ``secure_aggregation`` (Flower's SecAgg+ for the replies of the FedAvg family, over Flower
#: only: ``true`` or a dict of :data:`SECURE_AGGREGATION_DEFAULTS` keys; :func:`check_secure_aggregation`).
#: ``cross_test`` (:data:`UNDER_DP`, :func:`check_under_dp`): what the Global Test may
#: do in a run with differential privacy, which it leaves by sending every client's evaluation
#: model in the clear; absent, a private run with ``cross_test`` in ``eval_splits`` is refused.
#: ``uncovered_entries`` (:data:`UNDER_DP`, :func:`check_under_dp`): what a run
#: whose model is noised does with reply entries beside the model that no DP covers; absent, it
#: is refused (:func:`uncovered_in_clear`).
#: ``absences`` (:func:`check_absences`): a scripted schedule of clients left out of given
#: rounds' exchanges, as if they had dropped out (replaying a deployment's dropouts in process).
#: ``tracking`` (:func:`check_tracking`): the experiment trackers, e.g. ``[{"name": "mlflow",
#: "uri": "http://127.0.0.1:5000"}, {"name": "tensorboard"}]`` (:mod:`medfl.tracking`).
#: ``threads`` (:func:`check_threads`): torch's intra-op threads in each process that trains, a
#: positive integer or ``"auto"`` (the cores this process may use shared among the processes that
#: train beside it, :func:`auto_threads`); ``--threads N`` (``MEDFL_THREADS``) overrides it.
FL_OPTIONAL: dict[str, Any] = {"plots": True, "secure_aggregation": None, "cross_test": None, "absences": None,
                               "threads": "auto", "tracking": None, "uncovered_entries": None,
                               # written by medfl: {kind: {name as written: "dist:name" it resolved to}}
                               "plugin_names": None}

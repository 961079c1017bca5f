"""One site of a medfl bundle as MONAI's single-site training workflow, so that MONAI FL's
``monai.fl.client.MonaiAlgo`` (and NVIDIA FLARE's MONAI integration, which runs it) can
drive a bundle: FedAvg-family federated learning is single-site training plus a weight
exchange that MONAI FL's server side does.

Every training bundle's ``configs/train.json`` holds, beside its ``fl`` section (medfl's own
federated experiment, still run by ``"run"``), MONAI's ``train#trainer`` (a
``SupervisedTrainer``) and ``validate#evaluator`` (a ``SupervisedEvaluator`` with the key
metric ``val_accuracy``). Their data come from :class:`Site`: the ``client_id`` of the
bundle's partition (a top-level config key, default 0), its rows drawn by medfl's own
dataset and partition machinery (:func:`medfl.engine.data.split_data`, the ``fl`` section's
``dataset``, ``partition``, ``client_split``, ``seed``...) exactly as the in-process engine
and a Flower site draw them, so site ``k`` under MONAI FL trains on what client ``k`` trains on
under medfl.

Nothing is read when the config is parsed (:class:`SiteDataset` and :class:`SiteLoader` are
lazy), so ``MonaiAlgo.initialize`` and MONAI's ``check_properties`` need no data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from medfl.config import ConfigError, resolve_config

__all__ = ["ROLES", "Site", "SiteDataset", "SiteLoader"]

#: The roles of a site's split that a workflow can read.
ROLES = ("train", "val", "test")


class Site:
    """One client of a bundle's partition, for MONAI's single-site workflow.

    Args:
        fl: the bundle's ``fl`` section (MONAI has resolved its references); read through
            :func:`medfl.config.resolve_config`, so its defaults are medfl's.
        client_id: the client this site is: a client id of the partition (``0`` ..
            ``num_clients - 1``, as an int or a string) or a client's name (a ``natural``
            partition's site or region, ``client_<id>`` otherwise).

    Raises:
        ConfigError: ``fl`` is not a valid medfl config (on first use of :attr:`cfg`).
    """

    def __init__(self, fl: Mapping[str, Any], client_id: int | str = 0) -> None:
        if isinstance(client_id, bool) or not isinstance(client_id, (int, str)):
            raise ConfigError(f"client_id: expected a client id (0, 1, ...) or a client's name, "
                              f"got {client_id!r}")
        self.fl = dict(fl)
        self.client_id = client_id
        self._cfg: dict[str, Any] | None = None
        self._data: Any = None
        self._cid: str | None = None

    @property
    def cfg(self) -> dict[str, Any]:
        """The resolved ``fl`` section (:func:`medfl.config.resolve_config`)."""
        if self._cfg is None:
            self._cfg = resolve_config(self.fl)
        return self._cfg

    @property
    def epochs(self) -> int:
        """Local epochs of one round: the ``fl`` section's ``train.epochs`` (MONAI FL's
        ``local_epochs`` replaces it as the trainer's ``max_epochs``)."""
        return int(self.cfg["train"].get("epochs", 1))

    @property
    def eval_split(self) -> str:
        """The split the evaluator scores: ``val``, or ``test`` where the bundle's
        ``client_split`` has no validation part (``{"train": 0.85, "val": 0.0, ...}``)."""
        return "val" if float(self.cfg["client_split"].get("val", 0) or 0) > 0 else "test"

    def data(self) -> tuple[Any, str]:
        """The split of the whole federation and this site's client id in it, drawn once
        (:func:`medfl.engine.data.split_data` with the config's seed; no cross-validation fold).

        Raises:
            ConfigError: :attr:`client_id` is neither a client id nor a client's name of the
                partition (the message lists both).
            DataError: the dataset cannot be read or split (from medfl's data layer).
        """
        if self._data is None:
            from medfl.engine.data import split_data
            from medfl.engine.runner import build_source

            data = split_data(build_source(self.cfg["dataset"]), self.cfg)
            names = data.client_names()
            wanted = str(self.client_id)
            cid = wanted if wanted in names else next((c for c, n in names.items() if n == wanted), None)
            if cid is None:
                clients = ", ".join(f"{c} ({n})" for c, n in names.items())
                raise ConfigError(f"client_id: {self.client_id!r} is not a client of this bundle's partition; "
                                  f"clients (id and name): {clients}")
            self._data, self._cid = data, cid
        return self._data, str(self._cid)

    def dataset(self, split: str) -> SiteDataset:
        """This site's ``split`` (``train``, ``val`` or ``test``) as a lazy dataset of
        ``{"image", "label"}`` dicts (:class:`SiteDataset`)."""
        return SiteDataset(self, split)

    def optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The local optimizer of the ``fl`` section's ``train`` settings (``optimizer``,
        ``lr``, ``momentum``, ``weight_decay``), as medfl's clients build it."""
        from medfl.training import make_optimizer

        return make_optimizer(params, self.cfg["train"])


class SiteDataset(Dataset):
    """One site's ``split`` as a torch dataset of ``{"image": tensor (C, H, W[, D]),
    "label": int}`` dicts (the keys MONAI's engines read), with the dataset's transforms
    (augmentation on ``train`` only, as medfl's clients train). Nothing is read until the
    first use.

    Args:
        site: the site (:class:`Site`).
        split: ``train``, ``val`` or ``test``.

    Raises:
        ConfigError: ``split`` is not one of those.
    """

    def __init__(self, site: Site, split: str) -> None:
        if split not in ROLES:
            raise ConfigError(f"site dataset: split {split!r} is not one of {', '.join(ROLES)}")
        self.site = site
        self.split = split
        self._ds: Dataset | None = None

    def _built(self) -> Dataset:
        if self._ds is None:
            data, cid = self.site.data()
            self._ds = data.dataset_factories(cid, [self.split])[self.split]()
        return self._ds

    def __len__(self) -> int:
        return len(self._built())  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, y = self._built()[i]
        return {"image": x, "label": int(y)}


class SiteLoader:
    """Batches of a :class:`SiteDataset`: a ``torch.utils.data.DataLoader`` built on the
    first iteration, with the ``fl`` section's batch size (``train.batch_size`` for
    ``train``, ``train.eval_batch_size`` otherwise) and ``train.num_workers``, shuffled
    (``train`` only) from a seed of the run seed and the site.

    It has no length before the data are read: MONAI's engines then take the epoch length
    from the first pass (ignite's ``epoch_length=None``), and parsing the workflow reads
    no data.

    Args:
        dataset: the site's split.
        batch_size: ``None``: the ``fl`` section's.
        shuffle: ``None``: shuffle the ``train`` split only.
    """

    def __init__(self, dataset: SiteDataset, batch_size: int | None = None, shuffle: bool | None = None) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self._loader: DataLoader | None = None

    @property
    def loader(self) -> DataLoader:
        """The underlying ``DataLoader`` (built, and the data read, on first use)."""
        if self._loader is None:
            from medfl.seeding import derive_seed

            site, split = self.dataset.site, self.dataset.split
            train = site.cfg["train"]
            bs = self.batch_size or (train.get("batch_size", 16) if split == "train"
                                     else train.get("eval_batch_size", 64))
            workers = int(train.get("num_workers", 0))
            gen = torch.Generator().manual_seed(derive_seed(int(site.cfg["seed"]), "monai_fl", str(site.client_id),
                                                            split))
            init = None
            if workers:
                from monai.data.utils import worker_init_fn as init
            self._loader = DataLoader(self.dataset, batch_size=int(bs),
                                      shuffle=(split == "train") if self.shuffle is None else bool(self.shuffle),
                                      generator=gen, num_workers=workers, worker_init_fn=init)
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

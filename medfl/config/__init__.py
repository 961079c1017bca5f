"""The ``fl`` section of a bundle config: defaults, validation and resolution.

A bundle's ``train.json`` holds the experiment under the key ``fl``; every key can be
overridden from MONAI's command line (``--fl#rounds 3``, ``--fl#methods#0#name fedprox``).
Unknown keys and unknown plugin names fail with an error listing the valid ones.

This package's modules each read one part (their docstrings say which); it re-exports the
public names used elsewhere, and :mod:`medfl.config_values`'s (:class:`ConfigError`, :func:`read_bool`).
"""

from __future__ import annotations

from medfl.config.defaults import DEFAULTS, FL_OPTIONAL
from medfl.config.methods import (CROSS_TEST_IN_CLEAR, build_method, cross_test_in_clear, method_label, method_params,
                                  method_preset, method_train, preset_counts, preset_origin, preset_record,
                                  uncovered_in_clear, uncovered_keys)
from medfl.config.resolve import PUBLIC_KEYS, check_public_dataset, resolve_config
from medfl.config.sections import (ABSENCE_PHASES, BACKEND_DEFAULTS, SECURE_AGGREGATION_MODULUS, TEST_SPLITS,
                                   check_absences, check_device, check_dp_sgd, check_early_stopping,
                                   check_secure_aggregation, check_tracking)
from medfl.config.threads import (LOCAL_SITES_ENV, THREADS_ENV, actor_threads, auto_threads, available_cores,
                                  check_threads, local_sites, resolve_threads, set_threads, sharing_processes,
                                  threads_record, threads_setting)
from medfl.config_values import ConfigError, read_bool

__all__ = ["ConfigError", "DEFAULTS", "FL_OPTIONAL", "PUBLIC_KEYS", "resolve_config", "check_public_dataset",
           "method_label", "build_method", "method_params", "method_preset", "method_train", "preset_record",
           "preset_origin", "preset_counts", "CROSS_TEST_IN_CLEAR", "cross_test_in_clear", "uncovered_keys",
           "uncovered_in_clear", "ABSENCE_PHASES", "BACKEND_DEFAULTS", "SECURE_AGGREGATION_MODULUS", "TEST_SPLITS",
           "check_absences", "check_device", "check_dp_sgd", "check_early_stopping", "check_secure_aggregation",
           "check_tracking", "THREADS_ENV", "LOCAL_SITES_ENV", "check_threads", "available_cores",
           "sharing_processes", "auto_threads", "threads_setting", "resolve_threads", "set_threads", "local_sites",
           "actor_threads", "threads_record", "read_bool"]

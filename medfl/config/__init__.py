"""The ``fl`` section of a bundle config: defaults, validation and resolution.

A bundle's ``train.json`` holds the experiment under the key ``fl``; every key can be
overridden from MONAI's command line (``--fl#rounds 3``, ``--fl#methods#0#name fedprox``).
Unknown keys and unknown plugin names fail with an error listing the valid ones.

This package's modules each read one part (their docstrings say which); it re-exports their
public names, and :mod:`medfl.config_values`'s (:class:`ConfigError`, :func:`read_bool`).
"""

from __future__ import annotations

from medfl.config.defaults import DEFAULTS, FL_OPTIONAL, TRAIN_OPTIONAL
from medfl.config.in_clear import (CROSS_TEST_DEFAULTS, CROSS_TEST_IN_CLEAR, CROSS_TEST_UNDER_DP, UNCOVERED_DEFAULTS,
                                   UNCOVERED_UNDER_DP, check_cross_test, check_uncovered_entries, cross_test_in_clear,
                                   uncovered_in_clear, uncovered_keys)
from medfl.config.methods import (ENTRY_KEYS, build_method, method_label, method_params, method_preset, method_train,
                                  preset_counts, preset_origin, preset_record)
from medfl.config.resolve import (PUBLIC_KEYS, PUBLIC_TEST_FRACTION, check_plugin_names, check_public_dataset,
                                  plugin_names, resolve_config)
from medfl.config.sections import (ABSENCE_PHASES, BACKEND_DEFAULTS, DP_SGD_DEFAULTS, EARLY_STOPPING_DEFAULTS,
                                   OPTIMIZERS, SECURE_AGGREGATION_DEFAULTS, SECURE_AGGREGATION_MODULUS, TEST_SPLITS,
                                   check_absences, check_backend, check_device, check_dp_sgd, check_early_stopping,
                                   check_min_sites, check_secure_aggregation, check_tracking, check_train)
from medfl.config.threads import (LOCAL_SITES_ENV, THREADS_AUTO, THREADS_ENV, actor_threads, auto_threads,
                                  available_cores, check_threads, local_sites, resolve_threads, set_threads,
                                  sharing_processes, threads_record, threads_setting)
from medfl.config_values import BOOL_WORDS, ConfigError, read_bool, read_plugin_values

__all__ = ["ConfigError", "DEFAULTS", "ENTRY_KEYS", "DP_SGD_DEFAULTS", "PUBLIC_KEYS", "PUBLIC_TEST_FRACTION",
           "OPTIMIZERS", "resolve_config", "method_label", "build_method", "method_params", "method_preset",
           "preset_record", "preset_origin", "preset_counts", "method_train", "check_dp_sgd",
           "check_public_dataset", "check_train", "check_device",
           "check_backend", "check_tracking", "check_min_sites", "BACKEND_DEFAULTS", "TRAIN_OPTIONAL", "FL_OPTIONAL",
           "EARLY_STOPPING_DEFAULTS", "TEST_SPLITS", "check_early_stopping", "ABSENCE_PHASES", "check_absences",
           "SECURE_AGGREGATION_DEFAULTS", "SECURE_AGGREGATION_MODULUS", "check_secure_aggregation",
           "CROSS_TEST_DEFAULTS", "CROSS_TEST_UNDER_DP", "check_cross_test", "cross_test_in_clear",
           "CROSS_TEST_IN_CLEAR", "check_uncovered_entries", "uncovered_keys", "uncovered_in_clear",
           "UNCOVERED_DEFAULTS", "UNCOVERED_UNDER_DP", "BOOL_WORDS", "read_bool", "read_plugin_values",
           "check_plugin_names", "plugin_names", "THREADS_AUTO", "THREADS_ENV", "LOCAL_SITES_ENV", "check_threads",
           "available_cores", "sharing_processes", "auto_threads", "threads_setting", "resolve_threads", "set_threads",
           "local_sites", "actor_threads", "threads_record"]

"""medfl over NVIDIA FLARE: the coordinator as an NVFlare controller workflow, each site as an
NVFlare executor (the ``nvflare`` backend, ``pip install 'medfl[nvflare]'``; docs/nvflare.md).

- :mod:`medfl.nvflare.transport`: :class:`~medfl.nvflare.transport.NVFlareTransport`, which
  carries the coordinator's messages (:class:`medfl.engine.remote.RemoteRun`, the same as over
  Flower) as NVFlare tasks;
- :mod:`medfl.nvflare.executor`: :class:`~medfl.nvflare.executor.MedflExecutor`, the site side
  (the same :class:`medfl.site.Site` a Flower SuperNode runs: approvals, the site's
  privacy policy, the release ledger, the content guard, state kept per site);
- :mod:`medfl.nvflare.controller`: :class:`~medfl.nvflare.controller.MedflController`, the
  workflow that runs the experiment on the NVFlare server;
- :mod:`medfl.nvflare.job`: :func:`~medfl.nvflare.job.write_job` (``medfl nvflare job``: a job
  folder naming no folder of the machine that wrote it), :func:`~medfl.nvflare.job.write_site`
  (``medfl nvflare site``: a site's NVFlare settings locked down to medfl) and
  :func:`~medfl.nvflare.job.simulate_job` (``medfl nvflare simulate``: a job folder run in
  NVFlare's simulator through its ``SimEnv``, NVFlare 2.9's replacement of ``nvflare simulator``).

NVFlare is imported by these modules, not by this package.
"""

from __future__ import annotations

__all__ = ["RESUME_JOB"]

#: the ``--out`` of the job that continues a stopped run, as its "continue with" hint names it
#: (:meth:`medfl_plugins.backends.NVFlare.resume_command`: ``medfl nvflare job --resume RUN_DIR
#: --out medfl_resume_job``, run in the server's directory)
RESUME_JOB = "medfl_resume_job"

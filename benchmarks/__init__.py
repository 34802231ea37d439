"""The benchmark harness of parallel_backend: ``python -m benchmarks <subcommand>``.

Run from the repository root (the package is not installed with parallel_backend).

=============  ==========================================================================
``gradients``  one value-and-gradient per evaluation, in a compiled loop: plain NumPyro
               against ``serial``, ``thread``, ``thread_host`` (and ``dask``,
               ``dask_host`` with ``--dask-workers``/``--dask-address``); ``--sets N``
               for N vectorized chains' parameter sets
``device``     the same against ``DeviceExecutor`` over every device (forced CPU devices
               with ``--cpu-devices`` where there is no accelerator)
``observe``    NumPyro distributions as plain NumPyro, ``pb.factor`` and ``pb.observe``
``scaling``    ``ThreadExecutor(w, dispatch="host")`` against plain pinned to the same
               ``w`` cores, one process per ``w``
``nuts``       NUTS end to end through ``numpyro.infer.MCMC`` (warmup and compilation
               included), with milliseconds per gradient of the sampling phase
``report``     markdown tables from records
``plot``       the plots of ``docs/performance.md`` (``docs/_static/*.png``) from records
=============  ==========================================================================

Every measuring subcommand times plain NumPyro and each variant in the same run, in
interleaved rounds, and keeps medians, with the timing code ``pb.profile`` uses
(``parallel_backend.plugins.numpyro.profile``); ``--out FILE`` appends one record
per variant to ``FILE`` in the one results format (:mod:`benchmarks.records`). The
likelihoods are :mod:`benchmarks.likelihoods`' catalogue. This ``__init__`` imports
nothing, so that ``benchmarks.netcluster`` and ``report`` start without JAX.

    python -m benchmarks gradients --likelihoods hmm_1k,hmm_50k --rounds 5 --out run.jsonl
    python -m benchmarks report run.jsonl
"""

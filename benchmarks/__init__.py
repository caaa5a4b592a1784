"""atorch benchmarks: one command each, see README.md. (A package so that fairscale's top-level
``benchmarks`` package in site-packages does not shadow this one.)"""

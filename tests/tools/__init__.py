"""The tools: benchmarks, the manual (build, figures), the starter maker and the digits folder."""

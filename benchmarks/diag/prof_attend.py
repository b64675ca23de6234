"""cProfile of cache_step.py (isoquant3 at 2K, 48 layers, 32 decode steps, 2 rounds): where attend's host time goes
(run on the GPU machine: benchmarks/device_runs/run_s15d_gpu.sh)."""
import cProfile, pstats, sys, io
sys.argv = ["cache_step.py", "--contexts", "2048", "--layers", "48", "--steps", "32", "--rounds", "2", "--kinds", "isoquant3"]
sys.path.insert(0, "benchmarks")
import cache_step
pr = cProfile.Profile()
pr.enable()
cache_step.main()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue()[:8000])

"""The cluster simulator and capacity planner: our scheduler and KV cache manager in virtual time
on a step-cost model measured on this host (`bench calibrate`), behind the cluster's routing
policies, driven by the benchmarks' workloads scaled up to a district."""

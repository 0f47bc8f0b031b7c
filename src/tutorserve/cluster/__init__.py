"""tutorserve on a cluster: engine replicas on Ray Serve, behind our routing policy plugged in
as Serve's request router, with the same engine front (`ClusterFront`) that the server and the
tutor use for one local engine; or prefill and decode replicas, a prompt's KV blocks moving
from one to the other through the shared disk tier (`DisaggFront`)."""

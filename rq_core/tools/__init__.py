"""Measurement tools behind rq eval, rq profile, rq soak and rq bench."""

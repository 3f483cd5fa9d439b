"""Deployments of the server beyond one process: `deploy.ray`, replicas under Ray Serve (ARCHITECTURE §1, §2).

Each replica is the same FastAPI app over the same `TTSService` as production_server.py; this package
only wires them into a deployment system. It may import `api/` (the entry points and deploy/ do).
"""

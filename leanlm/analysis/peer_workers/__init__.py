"""Scripts that run a benchmark peer inside that peer's own virtual environment (OpenVINO GenAI, vLLM's CPU build),
started by leanlm.analysis.peer_process. They are run by file path, not imported: each imports only the standard
library, its own stack and its siblings here (worker_io, proc_cpu), never leanlm, whose torch and packages those
environments do not have.
"""

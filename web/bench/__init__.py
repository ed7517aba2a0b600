"""`parkq bench`: one workload against parkq (with and without preemption), the
peer `llama_cpp.server`, and an idle engine; figures, JSON and a PNG."""

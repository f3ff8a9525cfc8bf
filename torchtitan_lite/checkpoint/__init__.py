"""Checkpoints: DCP save/commit/retention/resume (:mod:`.manager`), safe reading
(:mod:`.safe_reading`) and Hugging Face safetensors folders (:mod:`.hf_storage`)."""

"""Quality measurements of lossy paths against the lossless one (teacher-forced, same model)."""

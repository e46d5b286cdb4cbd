"""Drop-in front ends for scripts written against other FSDP APIs."""

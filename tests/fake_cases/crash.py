"""A case that crashes with a traceback after one step."""

from _common import case_dir, step


def update_actor() -> None:
    raise RuntimeError("shape mismatch in update_actor: [4, 8] vs [4, 9]")


step(case_dir(), 1)
print("some unrelated line after step 1", flush=True)
update_actor()

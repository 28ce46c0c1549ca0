"""End of a rank program: tear the process groups down so that nothing of them outlives the call.

``torch.distributed.destroy_process_group()`` forgets every group, but a gloo group's C++ object
(two ``pt_gloo_runloop`` worker threads, the ``gloo_tcp_loop`` I/O thread and the TCP pairs to the
peers) lives on while any Python object still holds it. After any DTensor work something always
does: torch 2.13 keeps ``DeviceMesh`` objects in module-level caches
(``torch.distributed.tensor._redistribute._planner_cache``, the ``lru_cache`` of
``_gen_transform_infos`` keyed by ``DTensorSpec``, the sharding-propagation caches) and every
mesh holds its groups in ``DeviceMesh._pg_registry``. And a module imported after
``init_process_group`` (``torch.distributed.nn.functional``, pulled in by the first DTensor through
``torch._dynamo``) binds the default group as a default argument value (``group=group.WORLD``,
evaluated at import). The threads then run on through interpreter finalization and the C++
static destructors, the peer's exit wakes the I/O thread in the middle of them, and the kernel's
``exit_group`` finally kills them, never joined (``strace -f`` shows it). Gloo threads left running
into exit are a known cause of aborts at exit (pytorch/pytorch#190489: ``terminate called without
an active exception`` when a gloo group is not destroyed) and the likely one of the rare aborts
reported in issue 17; those aborts themselves did not reproduce here (``docs/crashes.md``).

:func:`destroy_process_groups` destroys the groups, then drops the groups every live mesh still
holds and resets such default arguments to ``None`` (which the collectives read as the default
group, as an import before ``init_process_group`` would have bound), so the last reference goes
now and the groups' destructors join their threads and close their sockets while the interpreter
is whole. ``tests/test_clean_exit.py`` checks that no gloo thread is left when a rank program
returns.
"""

from __future__ import annotations

import gc
import types


def destroy_process_groups(*, failed: bool = False) -> None:
    """Destroy every process group of this process and release them at once (the end of a job).

    A barrier first waits until every rank is past its last collective, so no rank closes its
    connections while a peer still communicates; after it, the groups' threads are joined here.
    The scan for what still holds a group costs about 0.1-0.3 s. Every ``DeviceMesh`` of the
    process is unusable afterwards. Does nothing when no group is initialized.

    ``failed=True`` is for an error path, where a peer may never reach the barrier or may still
    wait in a collective with this rank: no barrier, and the groups are only destroyed, not
    released (joining gloo's threads could wait for that peer; the process is failing anyway)."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        return
    if failed:
        dist.destroy_process_group()
        return
    dist.barrier()
    dist.destroy_process_group()
    # What still holds a group (module docstring) is found by type: torch's caches have no public
    # clear-all, and the default arguments are bound wherever a module was imported late.
    # (type(), not isinstance: some torch objects warn when their __class__ is read)
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
        elif kind is types.FunctionType:
            if obj.__defaults__ and any(isinstance(d, ProcessGroup) for d in obj.__defaults__):
                obj.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d for d in obj.__defaults__)
            if obj.__kwdefaults__ and any(isinstance(d, ProcessGroup) for d in obj.__kwdefaults__.values()):
                obj.__kwdefaults__ = {
                    k: None if isinstance(d, ProcessGroup) else d for k, d in obj.__kwdefaults__.items()
                }

"""What every room of the package builds on, and nothing of theirs: argument checks that name the argument
(``checks``), a module's tensors by ``state_dict`` name, looked up cheaply on every call (``module_tensors``), FSDP2's
sharded tensors (``sharding``), grouped in-place writes that autograd sees on every device (``foreach_writes``), flat
views of same-dtype tensors (``flat``) and torch's private surfaces, each fenced in one place (``torch_internals``).

Copy contract: these helpers hold references and write only where a caller names the destination (``foreach_copy_``,
``foreach_lerp_``: into existing storage, every destination's version raised by one, nothing allocated). No name
here is public: the rooms above export what users call.
"""

__all__: list[str] = []

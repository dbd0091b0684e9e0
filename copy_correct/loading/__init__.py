"""Loading batches onto the device: ``DevicePrefetcher`` (the next batch's host-to-device copy on a side stream,
overlapping compute), ``map_tensors`` (a function over every tensor of a nested batch), ``DeviceDataLoader`` and
``make_loader`` (a loader that pins only for an accelerator, with or without the prefetcher).

Copy contract: a batch is copied to the device once, from pinned memory where the loader pins, and the copy is
waited for on the compute stream before it is used; the host batch is not kept past its copy.
"""

from copy_correct.loading.device_loader import DeviceDataLoader, make_loader
from copy_correct.loading.prefetch import DevicePrefetcher, map_tensors

__all__ = ["DeviceDataLoader", "DevicePrefetcher", "make_loader", "map_tensors"]

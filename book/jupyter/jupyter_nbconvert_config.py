"""nbconvert settings for the book's build: every page's kernel talks over local IPC sockets.

Over TCP (the default) each kernel logs that its traffic is unencrypted: one identical warning
per executed page, which hides a real one. Local IPC sockets remove the cause. Their path must
be unique per kernel: two builds of the same checkout can run at the same time (a build and
the site test), and the default path, `kernel-ipc` in the working directory, would let one
build's client talk to the other build's kernel. nbconvert reads this file once per page, so
each kernel gets a fresh name, in a private directory of the build process (book/hooks.py
removes it at the end).
"""

import os
import tempfile
import uuid

KERNEL_DIR = os.environ.get("TINYTRON_KERNEL_DIR") or os.path.join(
    tempfile.gettempdir(), f"tinytron-kernels-{os.getuid()}-{os.getpid()}")

if "get_config" in globals():  # read by nbconvert's config loader
    os.makedirs(KERNEL_DIR, mode=0o700, exist_ok=True)
    c = get_config()  # noqa: F821 - provided by the traitlets config loader
    c.KernelManager.transport = "ipc"
    c.KernelManager.ip = os.path.join(KERNEL_DIR, uuid.uuid4().hex[:16])

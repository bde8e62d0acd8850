"""Gradients as views into flat bucket buffers (``gradient_as_bucket_view=True`` of
``kvstore.torch.DistributedOptimizer``), as DDP's option of that name keeps them.

Each bucket is one store key: its gradients are summed in place, in one buffer, with no copy of
each parameter's gradient into a packed buffer and out again. Each view has its parameter's
strides (a channels_last or transposed parameter's gradient is laid out as the parameter, as
fused optimizers need), over the parameter's own span of the buffer.

Autograd accumulates into a gradient that exists. So a hook that runs before it accumulates
(``arriving``) makes a ``None`` gradient the parameter's view, zeroed: backward writes into the
bucket with no copy, while a parameter backward does not reach keeps ``None``, as in plain torch.
A gradient made elsewhere (assigned by the caller, or by backward with ``create_graph``) is
copied into its view (``adopt``) before it is summed.

A view made the gradient to carry zeros (``fill``: a parameter used on another worker only)
does not hold a gradient of this worker: ``live`` keeps that apart, and at the end of the
synchronization a parameter that got none on any worker gets back its ``None``.
"""

import torch


class GradBuckets:
    """The flat gradient buffers of the parameters ``indices`` of ``params``, in buckets of
    about ``cap`` bytes in reverse order (backward reaches the last layers first), each of one
    dtype and device; bucket ``b`` is the store key ``key(b)``. The same on every worker: the
    model is."""

    def __init__(self, params, indices, cap, key):
        self.members = []  # per bucket: its parameters' indices
        self.flats = []  # per bucket: its flat buffer
        self.keys = []  # per bucket: its store key
        self.bucket = {}  # parameter index -> its bucket
        self.views = {}  # parameter index -> its view into its bucket's buffer
        self.live = {}  # parameter index -> whether its view holds a gradient
        # parameter index -> whether its view is known to be zeros (the wrapper's zero_grad
        # zeroes a bucket's buffer at once: no zero_ per parameter when backward reaches it)
        self.zeroed = {}
        run, size = [], 0
        for i in reversed(indices):
            p = params[i]
            if run and (p.dtype, p.device) != (params[run[0]].dtype, params[run[0]].device):
                self._close(params, run, key)
                run, size = [], 0
            run.append(i)
            size += p.numel() * p.element_size()
            if size >= cap:
                self._close(params, run, key)
                run, size = [], 0
        if run:
            self._close(params, run, key)

    def _close(self, params, run, key):
        b = len(self.flats)
        first = params[run[0]]
        flat = torch.zeros(
            sum(params[i].numel() for i in run), dtype=first.dtype, device=first.device
        )
        at = 0
        for i in run:
            p = params[i]
            n = p.numel()
            # The parameter's own strides where it is dense (empty_like keeps them), else
            # contiguous ones: either way a dense span of n elements from `at`.
            strides = torch.empty_like(p, device="meta").stride()
            self.views[i] = flat.as_strided(p.shape, strides, at)
            self.bucket[i] = b
            self.live[i] = False
            self.zeroed[i] = True
            at += n
        self.members.append(list(run))
        self.flats.append(flat)
        self.keys.append(key(b))

    def holds(self, i, p):
        """Whether bucketed parameter ``i`` (``p``) has a gradient, as torch sees one."""
        g = p.grad
        return g is not None and (g is not self.views[i] or self.live[i])

    def arriving(self, i, p, g):
        """Before autograd accumulates ``g`` into bucketed parameter ``i`` (``p``): a ``None``
        gradient becomes the view, zeroed, so that it accumulates there. A sparse ``g`` is left
        to make a sparse gradient, which the wrapper refuses, naming the layer."""
        if p.grad is not None or g.layout != torch.strided:
            return
        view = self.views[i]
        if not self.zeroed[i]:
            view.zero_()  # (the buffers never require grad: no autograd to keep out)
        p.grad = view
        self.live[i] = False
        self.zeroed[i] = False

    def adopt(self, i, p):
        """Makes ``p``'s gradient its view: copied in where it is another tensor (one the
        caller assigned, or one backward made out of place, with ``create_graph``)."""
        g = p.grad
        if g is None or g.layout != torch.strided:
            return  # (a sparse gradient is refused, naming the layer, before any call)
        view = self.views[i]
        if g is not view:
            with torch.no_grad():  # (g may carry a graph: create_graph=True)
                view.copy_(g)
            p.grad = view
            self.zeroed[i] = False
        self.live[i] = True

    def fill(self, i, p):
        """A zero gradient for bucketed parameter ``i``, which has none here (used on another
        worker, or summed with its bucket)."""
        view = self.views[i]
        view.zero_()
        p.grad = view
        self.live[i] = False
        self.zeroed[i] = False  # (the sum writes it)

    def cleared(self, params):
        """After the wrapped optimizer's ``zero_grad``: each buffer whose parameters all have
        ``None`` gradients is zeroed at once, for backward to write into."""
        for members, flat in zip(self.members, self.flats):
            if all(params[i].grad is None for i in members) and not all(
                self.zeroed[i] for i in members
            ):
                flat.zero_()
                for i in members:
                    self.zeroed[i] = True

    def carriers(self, params, indices):
        """For ``indices`` (each with a gradient here or filled): the buckets that hold any of
        them, their gradients made the views first; and the indices outside every bucket."""
        buckets, alone = [], []
        for i in indices:
            b = self.bucket.get(i)
            if b is None:
                alone.append(i)
                continue
            self.adopt(i, params[i])
            if b not in buckets:
                buckets.append(b)
        for b in buckets:  # the sums write every parameter's span
            for i in self.members[b]:
                self.zeroed[i] = False
        return buckets, alone

    def settle(self, params, used):
        """At the end of a synchronization: each bucketed parameter used on some worker holds
        a gradient (the average); a view that carried zeros for one used on none is ``None``
        again."""
        for i, view in self.views.items():
            if used[i]:
                self.live[i] = params[i].grad is not None
            elif params[i].grad is view and not self.live[i]:
                params[i].grad = None

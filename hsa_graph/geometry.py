r"""Position embeddings per geometry: the per-node ``pos`` of :func:`~hsa_graph.hsa`.

HSA adds :math:`\langle \varepsilon(A), \varepsilon(B) \rangle` to the logit of two
siblings :math:`A, B` (:ref:`def-hsa`), where :math:`\varepsilon` is the position
embedding of their parent's geometry (paper section 3.2 and appendix C). A node's
encoding is therefore fixed by its position *in its parent's geometry*:

================  ===============================================================
parent geometry   raw feature of the child (stored in ``tree.position`` / ``key``)
================  ===============================================================
``sequence``      1-D random Fourier features or sinusoids of the index
``grid``          2-D random Fourier features or axial sinusoids of ``(row, col)``
``set``           zero (sets have no positions)
``keyvalue``      one vector per field name (:class:`FieldNameEmbedding`)
``graph``         Laplacian-eigenvector or random-walk encoding of the family graph
(root)            zero
================  ===============================================================

The raw-feature functions are public (:func:`sequence_encoding`,
:func:`grid_encoding`, :func:`set_encoding`, :func:`laplacian_encoding`,
:func:`random_walk_encoding`); :class:`PositionEncoder` computes them for a whole
:class:`~hsa_graph.NestedSignal` or a PyG ``Batch`` at once (grouped by parent
geometry) and projects each geometry type with its own learnable linear map, as in
the paper's appendix F.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.nn import Linear, Module, ModuleDict, Parameter
from torch_geometric.utils import get_laplacian, to_dense_adj, to_undirected

from .signal import GEOMETRIES
from .structure import Groups

__all__ = [
    "FieldNameEmbedding",
    "PositionEncoder",
    "fourier_encoding",
    "grid_encoding",
    "laplacian_encoding",
    "random_fourier_frequencies",
    "random_walk_encoding",
    "sequence_encoding",
    "set_encoding",
    "sinusoidal_encoding",
]

_CODE = {name: code for code, name in enumerate(GEOMETRIES)}
_PROJECTED = ("sequence", "grid", "keyvalue", "graph")  # 'set' and roots stay zero
_KINDS = ("fourier", "sinusoidal")
_GRAPH_KINDS = ("laplacian", "random_walk")
# Padding value on the diagonal of padded Laplacians: the symmetric normalised
# Laplacian has its spectrum in [0, 2], so padding eigenvalues sort after every real one.
_PAD_EIGENVALUE = 3.0


# --------------------------------------------------------------- 1-D and 2-D grids
def sinusoidal_encoding(index: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    r"""The Transformer's sinusoidal encoding of integer (or real) positions.

    .. math::
        e(p)_{2i} = \sin(p\, \omega_i), \quad e(p)_{2i+1} = \cos(p\, \omega_i), \qquad
        \omega_i = \mathrm{base}^{-2i/\mathrm{dim}}

    so :math:`\langle e(p), e(p') \rangle = \sum_i \cos((p - p')\, \omega_i)`
    depends only on the offset :math:`p - p'`.

    Args:
        index: positions ``[n]``.
        dim: even output size.
        base: wavelength base.

    Returns:
        ``[n, dim]`` in the default float dtype.

    Example:
        >>> sinusoidal_encoding(torch.tensor([0, 1]), 4)
        tensor([[0.0000, 1.0000, 0.0000, 1.0000],
                [0.8415, 0.5403, 0.0100, 0.9999]])
    """
    _check_dim(dim, 2, "sinusoidal_encoding")
    index = _as_positions(index, 1, "index").squeeze(-1)
    omega = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=index.device) / dim)
    angle = index.double().unsqueeze(-1) * omega
    out = torch.stack([angle.sin(), angle.cos()], -1).reshape(index.shape[0], dim)
    return out.to(torch.get_default_dtype())


def random_fourier_frequencies(in_dim: int, num: int, sigma: float = 1.0, seed: int = 0,
                               device: Optional[torch.device] = None) -> Tensor:
    r"""Fixed Gaussian frequencies :math:`W \sim \mathcal{N}(0, \sigma^2)` of shape
    ``[in_dim, num]`` for :func:`fourier_encoding`, reproducible from ``seed`` (drawn
    on the CPU, so equal on every device).

    Example:
        >>> torch.equal(random_fourier_frequencies(2, 8, seed=3),
        ...             random_fourier_frequencies(2, 8, seed=3))
        True
    """
    if in_dim < 1 or num < 1:
        raise ValueError(f"need in_dim >= 1 and num >= 1, got {in_dim} and {num}")
    if not sigma > 0:
        raise ValueError(f"sigma must be positive, got {sigma}")
    generator = torch.Generator().manual_seed(int(seed))
    w = torch.randn(in_dim, num, generator=generator, dtype=torch.float64) * sigma
    return w.to(device=device, dtype=torch.get_default_dtype())


def fourier_encoding(coords: Tensor, frequencies: Tensor) -> Tensor:
    r"""Random Fourier features (Rahimi & Recht) of coordinates.

    .. math::
        z(x) = \tfrac{1}{\sqrt{F}} \big[\cos(x W), \sin(x W)\big], \qquad
        \langle z(x), z(y) \rangle = \tfrac{1}{F} \textstyle\sum_f \cos((x - y) w_f)
        \approx e^{-\sigma^2 \lVert x - y \rVert^2 / 2}

    for Gaussian frequencies :math:`W \in \mathbb{R}^{d \times F}` of scale
    :math:`\sigma` (:func:`random_fourier_frequencies`). Every vector has unit norm and
    dot products depend only on the offset :math:`x - y`.

    Args:
        coords: ``[n]`` or ``[n, d]`` positions.
        frequencies: ``[d, F]``.

    Returns:
        ``[n, 2F]`` in the dtype of ``frequencies``.

    Example:
        >>> w = random_fourier_frequencies(1, 16)
        >>> z = fourier_encoding(torch.arange(5), w)
        >>> z.shape, bool(torch.allclose(z.norm(dim=1), torch.ones(5)))
        (torch.Size([5, 32]), True)
    """
    if frequencies.dim() != 2:
        raise ValueError(f"frequencies must be [d, F], got shape {tuple(frequencies.shape)}")
    coords = _as_positions(coords, frequencies.shape[0], "coords")
    angle = coords.to(torch.float64) @ frequencies.to(torch.float64)
    out = torch.cat([angle.cos(), angle.sin()], -1) / math.sqrt(frequencies.shape[1])
    return out.to(frequencies.dtype)


def sequence_encoding(index: Tensor, dim: int, kind: str = "fourier", sigma: float = 1.0,
                      seed: int = 0) -> Tensor:
    r"""Raw encoding of the children of a ``sequence`` node from their index:
    ``kind='fourier'`` (:func:`fourier_encoding` with seeded 1-D Gaussian
    frequencies of scale ``sigma``, as in the paper's text experiments) or
    ``'sinusoidal'`` (:func:`sinusoidal_encoding`).

    Args:
        index: ``[n]`` child indices.
        dim: even output size.

    Returns:
        ``[n, dim]``.

    Example:
        >>> sequence_encoding(torch.arange(3), 8).shape
        torch.Size([3, 8])
    """
    kind = _check_kind(kind)
    if kind == "sinusoidal":
        return sinusoidal_encoding(index, dim)
    _check_dim(dim, 2, "sequence_encoding")
    index = _as_positions(index, 1, "index")
    w = random_fourier_frequencies(1, dim // 2, sigma, seed, device=index.device)
    return fourier_encoding(index, w)


def grid_encoding(position: Tensor, dim: int, kind: str = "fourier", sigma: float = 1.0,
                  seed: int = 0) -> Tensor:
    r"""Raw encoding of the children of a ``grid`` node from their ``(row, col)``.

    * ``kind='fourier'``: 2-D random Fourier features with isotropic Gaussian
      frequencies ``[2, dim / 2]``: dot products approximate
      :math:`e^{-\sigma^2 (\Delta r^2 + \Delta c^2) / 2}` (rotation-invariant).
    * ``kind='sinusoidal'``: axial sinusoids, ``[e(row), e(col)]`` with ``dim / 2``
      features each (as in MAE / ViT 2-D sin-cos embeddings), so dot products are
      separable: :math:`\langle g(r, c), g(r', c') \rangle = \langle e(r), e(r')
      \rangle + \langle e(c), e(c') \rangle`.

    Args:
        position: ``[n, 2]`` ``(row, col)`` pairs.
        dim: output size (even for ``fourier``, a multiple of 4 for ``sinusoidal``).

    Returns:
        ``[n, dim]``.

    Example:
        >>> rc = torch.tensor([[0, 0], [0, 1], [1, 0]])
        >>> g = grid_encoding(rc, 8, kind="sinusoidal")
        >>> torch.equal(g[0, 4:], g[2, 4:]), torch.equal(g[0, :4], g[1, :4])  # col / row part
        (True, True)
    """
    kind = _check_kind(kind)
    position = _as_positions(position, 2, "position")
    if kind == "sinusoidal":
        _check_dim(dim, 4, "grid_encoding(kind='sinusoidal')")
        return torch.cat([sinusoidal_encoding(position[:, 0], dim // 2),
                          sinusoidal_encoding(position[:, 1], dim // 2)], 1)
    _check_dim(dim, 2, "grid_encoding")
    w = random_fourier_frequencies(2, dim // 2, sigma, seed, device=position.device)
    return fourier_encoding(position, w)


def set_encoding(count: int, dim: int, device: Optional[torch.device] = None) -> Tensor:
    """The encoding of ``count`` children of a ``set`` node: zeros ``[count, dim]``
    (a set has no positions; paper appendix C).

    Example:
        >>> set_encoding(2, 3)
        tensor([[0., 0., 0.],
                [0., 0., 0.]])
    """
    return torch.zeros(count, dim, device=device)


# --------------------------------------------------------------------- field names
class FieldNameEmbedding(Module):
    r"""One vector per field name: the position embedding of ``keyvalue`` children.

    Two ways to map names to rows:

    * **vocabulary** (default): rows are handed out to new names on the fly, in the
      order they are first seen, up to ``capacity`` (the weight is allocated once, so
      an optimiser holding it keeps working while the vocabulary grows). The
      vocabulary is saved in ``state_dict`` (``get_extra_state``). Optionally, each new
      name's row is initialised from ``text_embedding([name, ...])`` (any callable
      returning ``[len(names), dim]``, e.g. a sentence-embedding model), as the
      paper's appendix C suggests; with ``learnable=False`` rows stay fixed.
    * **hashing** (``num_buckets=B``): ``crc32(name) % B``; never grows, unseen names
      still get a (shared) vector; collisions are possible.

    Args:
        dim: embedding size.
        capacity: maximal vocabulary size (vocabulary mode).
        num_buckets: use hashing into this many rows instead of a vocabulary.
        vocabulary: names to register up front.
        text_embedding: initialiser of new names' rows (vocabulary mode only).
        learnable: whether the rows are trained.

    Shapes:
        names (a sequence of ``n`` strings) -> ``[n, dim]``.

    Example:
        >>> emb = FieldNameEmbedding(4)
        >>> e = emb(["title", "body", "title"])
        >>> e.shape, torch.equal(e[0], e[2]), emb.vocabulary
        (torch.Size([3, 4]), True, {'title': 0, 'body': 1})
    """

    def __init__(self, dim: int, capacity: int = 1024, *, num_buckets: Optional[int] = None,
                 vocabulary: Optional[Sequence[str]] = None,
                 text_embedding: Optional[Callable[[List[str]], Tensor]] = None,
                 learnable: bool = True):
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        if num_buckets is not None:
            if num_buckets < 1:
                raise ValueError(f"num_buckets must be positive, got {num_buckets}")
            if text_embedding is not None or vocabulary is not None:
                raise ValueError("hashed field names (num_buckets=...) cannot take a "
                                 "vocabulary or a text_embedding: a bucket holds many names")
        elif capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.dim = dim
        self.num_buckets = num_buckets
        self.capacity = capacity if num_buckets is None else num_buckets
        self.text_embedding = text_embedding
        self.vocabulary: Dict[str, int] = {}
        self.weight = Parameter(torch.empty(self.capacity, dim), requires_grad=learnable)
        self.reset_parameters()
        if vocabulary is not None:
            self.index(list(vocabulary))

    def reset_parameters(self) -> None:
        """Re-draw every row from N(0, 1); rows of names already in the vocabulary are
        re-initialised from ``text_embedding`` when one is given."""
        with torch.no_grad():
            self.weight.normal_()
        if self.text_embedding is not None and self.vocabulary:
            self._initialise(list(self.vocabulary))

    def index(self, names: Sequence[str]) -> Tensor:
        """The row of each name ``[n]`` (long), registering new names."""
        names = list(names)
        bad = next((i for i, name in enumerate(names) if not isinstance(name, str)), None)
        if bad is not None:
            raise TypeError(f"field name {bad} is {names[bad]!r}, not a string")
        unique = list(dict.fromkeys(names))  # distinct names, first-seen order
        if self.num_buckets is not None:
            row = {name: zlib.crc32(name.encode("utf-8")) % self.num_buckets for name in unique}
        else:
            new = [name for name in unique if name not in self.vocabulary]
            if len(self.vocabulary) + len(new) > self.capacity:
                raise ValueError(
                    f"the field-name vocabulary is full ({self.capacity} names) and "
                    f"{len(new)} new names arrived (e.g. {new[0]!r}); raise capacity= "
                    "or hash names with num_buckets=")
            for name in new:
                self.vocabulary[name] = len(self.vocabulary)
            if new and self.text_embedding is not None:
                self._initialise(new)
            row = self.vocabulary
        return torch.tensor([row[name] for name in names], dtype=torch.long,
                            device=self.weight.device)

    def forward(self, names: Sequence[str]) -> Tensor:
        """``[n, dim]``: the vector of each name."""
        return self.weight[self.index(names)]

    def _initialise(self, names: List[str]) -> None:
        values = torch.as_tensor(self.text_embedding(names))
        if values.shape != (len(names), self.dim):
            raise ValueError(f"text_embedding returned shape {tuple(values.shape)} for "
                             f"{len(names)} names; expected ({len(names)}, {self.dim})")
        rows = torch.tensor([self.vocabulary[name] for name in names], device=self.weight.device)
        with torch.no_grad():
            self.weight[rows] = values.to(self.weight)

    def get_extra_state(self) -> dict:
        return {"vocabulary": list(self.vocabulary)}

    def set_extra_state(self, state: dict) -> None:
        self.vocabulary = {name: i for i, name in enumerate(state["vocabulary"])}

    def __repr__(self) -> str:
        mode = (f"num_buckets={self.num_buckets}" if self.num_buckets is not None else
                f"capacity={self.capacity}, names={len(self.vocabulary)}")
        return f"{self.__class__.__name__}({self.dim}, {mode})"


# ----------------------------------------------------------------- family graphs
def _family_graph(edge_index: Tensor, family: Union[Tensor, Groups], width: int, name: str
                  ) -> Tuple[Tensor, Groups, Tensor]:
    """Checked undirected edges, the node groups and a zero float64 output ``[n, width]``."""
    if isinstance(family, Groups):
        groups = family
        family = groups.group
    elif not isinstance(family, Tensor) or family.dim() != 1 or family.is_floating_point():
        raise ValueError(f"{name}: family must be an integer tensor [n] or Groups")
    else:
        groups = None
    n = family.numel()
    edge_index = torch.as_tensor(edge_index, device=family.device)
    if edge_index.dim() != 2 or edge_index.shape[0] != 2 or edge_index.is_floating_point():
        raise ValueError(f"{name}: edge_index must be an integer tensor [2, E], got shape "
                         f"{tuple(edge_index.shape)}")
    edge_index = edge_index.long()
    if edge_index.numel() and bool(((edge_index < 0) | (edge_index >= n)).any()):
        raise ValueError(f"{name}: edge_index has nodes outside [0, {n - 1}]")
    across = family[edge_index[0]] != family[edge_index[1]]
    if bool(across.any()):
        e = int(across.nonzero()[0])
        raise ValueError(f"{name}: edge ({int(edge_index[0, e])}, {int(edge_index[1, e])}) "
                         "joins nodes of different families")
    groups = groups if groups is not None else Groups.of_labels(family.long())
    out = torch.zeros(n, width, dtype=torch.float64, device=family.device)
    return to_undirected(edge_index, num_nodes=n), groups, out


def _next_power_of_two(x: Tensor) -> Tensor:
    return torch.pow(2, torch.ceil(torch.log2(x.double().clamp_min(1)))).long()


def _eigh_batches(sizes: Tensor, dense_limit: int):
    """Yield ``(b, families)``: graphs padded to size ``b`` (a power of two), in chunks
    of bounded memory, for one batched dense eigendecomposition each; ``b = None`` for
    graphs above ``dense_limit``. (Not :class:`~hsa_graph.TreeStructure`'s buckets:
    these graphs are any labelled node sets, and ``eigh`` batches want few sizes.)"""
    padded = torch.where(sizes > 0, _next_power_of_two(sizes), 0)
    for b in torch.unique(padded[padded > 0]).tolist():
        fams = (padded == b).nonzero().flatten()
        if b > dense_limit:
            for f in fams.tolist():
                yield None, fams.new_tensor([f])
            continue
        chunk = max(1, 2 ** 24 // (b * b))  # <= 128 MiB of float64 per dense batch
        for lo in range(0, fams.numel(), chunk):
            yield b, fams[lo:lo + chunk]


def _dense_family_matrices(edge_index: Tensor, edge_weight: Tensor, fam: Tensor, slot: Tensor,
                           fams: Tensor, b: int, num_families: int) -> Tensor:
    """``[len(fams), b, b]`` dense matrices of the given families (PyG ``to_dense_adj``
    on the sub-batch of those families)."""
    rank = torch.full((num_families,), -1, dtype=torch.long, device=fam.device)
    rank[fams] = torch.arange(fams.numel(), device=fam.device)
    keep = rank[fam[edge_index[0]]] >= 0
    row, col = edge_index[0, keep], edge_index[1, keep]
    # Renumber nodes as (rank, slot) in a batch of padded families: node = rank * b + slot.
    local = torch.stack([rank[fam[row]] * b + slot[row], rank[fam[col]] * b + slot[col]])
    batch = torch.arange(fams.numel(), device=fam.device).repeat_interleave(b)
    return to_dense_adj(local, batch, edge_weight[keep], max_num_nodes=b,
                        batch_size=fams.numel())


def _fix_signs(vectors: Tensor) -> Tensor:
    """Make each column's entry of largest magnitude (the first one, up to rounding)
    positive: eigenvectors are only defined up to sign, this picks one per column
    deterministically. ``vectors``: ``[F, b, k]``."""
    magnitude = vectors.abs()
    top = magnitude.amax(1, keepdim=True)
    first = (magnitude >= top - 1e-9).int().argmax(1, keepdim=True)
    sign = torch.sign(vectors.gather(1, first))
    return vectors * torch.where(sign == 0, 1.0, sign).to(vectors.dtype)


def laplacian_encoding(edge_index: Tensor, family: Union[Tensor, Groups], k: int,
                       dense_limit: int = 2048) -> Tensor:
    r"""Laplacian-eigenvector encodings of many small graphs at once.

    Node ``u`` belongs to the graph ``family[u]``; ``edge_index`` holds edges between
    nodes of the same family (treated as undirected). Per family, this is PyG's
    :class:`~torch_geometric.transforms.AddLaplacianEigenvectorPE` (``is_undirected=
    True``): the eigenvectors of the symmetric normalised Laplacian
    :math:`L = I - D^{-1/2} A D^{-1/2}` (PyG's ``get_laplacian``) for the ``k``
    smallest eigenvalues after the first. Families of equal padded size go through one
    batched ``torch.linalg.eigh``; families larger than ``dense_limit`` call PyG's
    transform (sparse; needs ``scipy``). Columns a small family does not have are zero.

    Unlike PyG's transform (which flips signs at random, as training augmentation),
    each eigenvector's sign is fixed: its entry of largest magnitude is positive. In
    repeated eigenvalues the basis is arbitrary, as with any Laplacian encoding.

    Args:
        edge_index: ``[2, E]`` edges between nodes ``0 .. n-1``.
        family: ``[n]`` the graph of each node (any integer labels), or the nodes
            already grouped (:class:`~hsa_graph.structure.Groups`, e.g. a tree's
            families from :meth:`~hsa_graph.TreeStructure.family_groups`).
        k: number of eigenvectors.
        dense_limit: largest family handled by dense batched ``eigh``.

    Returns:
        ``[n, k]`` in the default float dtype.

    Example:
        >>> path = torch.tensor([[0, 1], [1, 2]])        # the path 0 - 1 - 2
        >>> pe = laplacian_encoding(path, torch.zeros(3, dtype=torch.long), k=1)
        >>> [round(v, 4) + 0.0 for v in pe.flatten().tolist()]   # the Fiedler vector
        [0.7071, 0.0, -0.7071]
    """
    if k < 1:
        raise ValueError(f"laplacian_encoding: k must be positive, got {k}")
    edge_index, groups, out = _family_graph(edge_index, family, k, "laplacian_encoding")
    n, fam, slot, sizes = out.shape[0], groups.group, groups.slot, groups.sizes
    if n == 0:
        return out.to(torch.get_default_dtype())
    lap_index, lap_weight = get_laplacian(edge_index, normalization="sym",
                                          dtype=torch.float64, num_nodes=n)
    for b, fams in _eigh_batches(sizes, dense_limit):
        if b is None:
            _laplacian_sparse(edge_index, fam, slot, int(fams), k, out)
            continue
        lap = _dense_family_matrices(lap_index, lap_weight, fam, slot, fams, b, sizes.numel())
        pad = torch.arange(b, device=lap.device) >= sizes[fams].unsqueeze(1)      # [F, b]
        lap = lap + torch.diag_embed(pad.to(lap.dtype) * _PAD_EIGENVALUE)
        _, vectors = torch.linalg.eigh(lap)                  # ascending eigenvalues
        vectors = vectors[:, :, 1:k + 1]                     # skip the trivial one
        exists = torch.arange(1, vectors.shape[2] + 1, device=lap.device) < sizes[fams, None]
        vectors = _fix_signs(vectors * exists.unsqueeze(1))  # zero the padding columns
        members = torch.isin(fam, fams).nonzero().flatten()
        rank = torch.full((sizes.numel(),), -1, dtype=torch.long, device=lap.device)
        rank[fams] = torch.arange(fams.numel(), device=lap.device)
        out[members, :vectors.shape[2]] = vectors[rank[fam[members]], slot[members]]
    return out.to(torch.get_default_dtype())


def _laplacian_sparse(edge_index: Tensor, fam: Tensor, slot: Tensor, f: int, k: int,
                      out: Tensor) -> None:
    from torch_geometric.data import Data
    from torch_geometric.transforms import AddLaplacianEigenvectorPE
    try:
        import scipy  # noqa: F401  (PyG's transform needs it for large graphs)
    except ImportError:
        raise ImportError("laplacian_encoding of a family larger than dense_limit uses "
                          "PyG's AddLaplacianEigenvectorPE, which needs scipy") from None
    members = (fam == f).nonzero().flatten()
    keep = fam[edge_index[0]] == f
    local = slot[edge_index[:, keep]]
    size = members.numel()
    kk = min(k, size - 2)
    data = AddLaplacianEigenvectorPE(kk, attr_name="pe", is_undirected=True)(
        Data(edge_index=local.cpu(), num_nodes=size))
    pe = _fix_signs(data.pe.to(out)[None])[0]
    out[members[torch.argsort(slot[members])], :kk] = pe


def random_walk_encoding(edge_index: Tensor, family: Union[Tensor, Groups], walk_length: int,
                         dense_limit: int = 2048) -> Tensor:
    r"""Random-walk encodings of many small graphs at once.

    Per family (graph ``family[u]``, edges treated as undirected), exactly PyG's
    :class:`~torch_geometric.transforms.AddRandomWalkPE`: with
    :math:`P = D^{-1} A` (degree clamped at 1), node ``u`` gets
    :math:`[P_{uu}, (P^2)_{uu}, \dots, (P^{L})_{uu}]`, the probabilities of returning
    to ``u`` after ``1 .. L`` steps. Families of equal padded size are batched
    (``[F, b, b]`` matrix powers); families above ``dense_limit`` call PyG's transform
    (sparse).

    Args:
        edge_index: ``[2, E]`` edges between nodes ``0 .. n-1``.
        family: ``[n]`` the graph of each node, or :class:`~hsa_graph.structure.Groups`
            (as in :func:`laplacian_encoding`).
        walk_length: ``L``.
        dense_limit: largest family handled densely.

    Returns:
        ``[n, walk_length]`` in the default float dtype.

    Example:
        >>> triangle = torch.tensor([[0, 1, 2], [1, 2, 0]])
        >>> random_walk_encoding(triangle, torch.zeros(3, dtype=torch.long), 3)[0]
        tensor([0.0000, 0.5000, 0.2500])
    """
    if walk_length < 1:
        raise ValueError(f"random_walk_encoding: walk_length must be positive, got {walk_length}")
    edge_index, groups, out = _family_graph(edge_index, family, walk_length,
                                            "random_walk_encoding")
    fam, slot, sizes = groups.group, groups.slot, groups.sizes
    if out.shape[0] == 0:
        return out.to(torch.get_default_dtype())
    ones = torch.ones(edge_index.shape[1], dtype=torch.float64, device=out.device)
    for b, fams in _eigh_batches(sizes, dense_limit):
        members = torch.isin(fam, fams).nonzero().flatten()
        if b is None:
            from torch_geometric.data import Data
            from torch_geometric.transforms import AddRandomWalkPE
            keep = fam[edge_index[0]] == int(fams)
            data = AddRandomWalkPE(walk_length, attr_name="pe")(
                Data(edge_index=slot[edge_index[:, keep]], num_nodes=members.numel()))
            out[members] = data.pe.to(out)[slot[members]]
            continue
        adj = _dense_family_matrices(edge_index, ones, fam, slot, fams, b, sizes.numel())
        walk = adj / adj.sum(-1, keepdim=True).clamp_min(1)
        power, steps = walk, [walk.diagonal(dim1=-2, dim2=-1)]
        for _ in range(walk_length - 1):
            power = power @ walk
            steps.append(power.diagonal(dim1=-2, dim2=-1))
        pe = torch.stack(steps, -1)                                   # [F, b, L]
        rank = torch.full((sizes.numel(),), -1, dtype=torch.long, device=fam.device)
        rank[fams] = torch.arange(fams.numel(), device=fam.device)
        out[members] = pe[rank[fam[members]], slot[members]]
    return out.to(torch.get_default_dtype())


# ------------------------------------------------------------------------ module
class PositionEncoder(Module):
    r"""Per-node position embeddings of a nested signal, ready for
    ``hsa(q, k, v, tree, pos=...)``.

    Each node is encoded by its position in its *parent's* geometry (see the module
    docstring): sequence and grid children by Fourier or sinusoidal features of
    ``tree.position``, keyvalue children by a :class:`FieldNameEmbedding` of
    ``tree.key``, graph children by :func:`laplacian_encoding` or
    :func:`random_walk_encoding` of their family's graph (``tree.sibling_edge_index``).
    Every geometry type then has its own learnable linear projection to
    ``heads * out_dim`` (paper appendix F); children of ``set`` nodes and roots get
    zero. All nodes of one geometry are encoded and projected at once, for one tree or
    a PyG ``Batch`` (a forest) alike.

    The paper feeds the same raw embeddings to every layer with a projection per
    layer: build one encoder per layer sharing ``field_names``, compute
    ``features = encoder.features(tree)`` once per forward pass, and call each layer's
    ``encoder(tree, features)``.

    Args:
        out_dim: ``P``, the embedding size per head.
        heads: ``H``; ``None`` returns ``[M, P]`` (shared by all heads).
        dim: raw feature size for sequence and grid (even; a multiple of 4 for
            sinusoidal grids) and for field names.
        kind: ``'fourier'`` (seeded random Fourier features) or ``'sinusoidal'``.
        sigma: Fourier frequency scale (kernel length scale ``1 / sigma`` positions).
        seed: seed of the Fourier frequencies.
        graph: ``'laplacian'`` or ``'random_walk'``.
        graph_dim: eigenvectors / walk length of the graph encoding.
        field_names: a :class:`FieldNameEmbedding` to use (shared across layers);
            by default a new one of size ``dim``.
        bias: whether the projections have a bias (then zero raw features do not map
            to zero, except for sets and roots, which are never projected).

    Shapes:
        - **input:** a :class:`~hsa_graph.NestedSignal` or ``Batch`` of ``M`` nodes.
        - **output:** ``[M, P]``, or ``[M, H, P]`` with ``heads``.

    Example:
        >>> import hsa_graph
        >>> tree = hsa_graph.NestedSignal.from_nested(
        ...     {"title": [torch.randn(8) for _ in range(3)],
        ...      "body": hsa_graph.Node([torch.randn(8) for _ in range(4)], "set")})
        >>> encoder = PositionEncoder(16, heads=2)
        >>> pos = encoder(tree)
        >>> pos.shape                                     # 10 nodes, 2 heads, 16
        torch.Size([10, 2, 16])
        >>> bool(pos[6:].eq(0).all())                     # the set's children
        True
        >>> q = k = v = torch.randn(tree.num_leaves, 2, 8)
        >>> hsa_graph.hsa(q, k, v, tree, pos=pos).shape
        torch.Size([7, 2, 8])
    """

    def __init__(self, out_dim: int, heads: Optional[int] = None, *, dim: int = 32,
                 kind: str = "fourier", sigma: float = 1.0, seed: int = 0,
                 graph: str = "laplacian", graph_dim: int = 8,
                 field_names: Optional[FieldNameEmbedding] = None, bias: bool = False):
        super().__init__()
        if out_dim < 1:
            raise ValueError(f"out_dim must be positive, got {out_dim}")
        if heads is not None and heads < 1:
            raise ValueError(f"heads must be positive or None, got {heads}")
        self.kind = _check_kind(kind)
        _check_dim(dim, 4 if self.kind == "sinusoidal" else 2, "PositionEncoder(dim=...)")
        if graph not in _GRAPH_KINDS:
            raise ValueError(f"graph must be one of {_GRAPH_KINDS}, got {graph!r}")
        if graph_dim < 1:
            raise ValueError(f"graph_dim must be positive, got {graph_dim}")
        self.out_dim, self.heads, self.dim = out_dim, heads, dim
        self.sigma, self.seed = sigma, seed
        self.graph, self.graph_dim = graph, graph_dim
        self.field_names = field_names if field_names is not None else FieldNameEmbedding(dim)
        if self.kind == "fourier":  # fixed frequencies, moved with the module
            self.register_buffer("sequence_frequencies",
                                 random_fourier_frequencies(1, dim // 2, sigma, seed))
            self.register_buffer("grid_frequencies",
                                 random_fourier_frequencies(2, dim // 2, sigma, seed))
        raw = {"sequence": dim, "grid": dim, "keyvalue": self.field_names.dim,
               "graph": graph_dim}
        width = out_dim * (heads or 1)
        self.lins = ModuleDict({name: Linear(raw[name], width, bias=bias) for name in _PROJECTED})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise the projections and the field-name embedding."""
        for lin in self.lins.values():
            lin.reset_parameters()
        self.field_names.reset_parameters()

    def features(self, tree) -> Dict[str, Tuple[Tensor, Tensor]]:
        """The raw (unprojected) features: for each projected geometry type, the
        node indices whose parent has it ``[n_g]`` and their features ``[n_g, d_g]``
        (field-name vectors keep their gradient)."""
        _check_tree(tree)
        parent = tree.parent
        device = parent.device
        has_parent = parent >= 0
        parent_geometry = torch.where(has_parent, tree.geometry[parent.clamp_min(0)], -1)
        position = tree.position
        dtype = self.lins["sequence"].weight.dtype
        out: Dict[str, Tuple[Tensor, Tensor]] = {}
        for name in _PROJECTED:
            nodes = (parent_geometry == _CODE[name]).nonzero().flatten()
            if nodes.numel() == 0:
                continue
            if name == "sequence":
                feat = self._sequence(position[nodes, 0])
            elif name == "grid":
                feat = self._grid(position[nodes])
            elif name == "keyvalue":
                keys = _flat_keys(tree)
                names = [keys[u] for u in nodes.tolist()]
                missing = next((u for u, key in zip(nodes.tolist(), names)
                                if not isinstance(key, str)), None)
                if missing is not None:
                    raise ValueError(f"node {missing} is a field of a keyvalue node but "
                                     "has no string key")
                feat = self.field_names(names)
            else:
                feat = self._graph(tree, nodes, device)
            out[name] = (nodes, feat.to(device=device, dtype=dtype))
        return out

    def forward(self, tree, features: Optional[Dict[str, Tuple[Tensor, Tensor]]] = None
                ) -> Tensor:
        """``[M, P]`` (or ``[M, H, P]``) position embeddings in node index order."""
        if features is None:
            features = self.features(tree)
        m = tree.num_nodes
        weight = self.lins["sequence"].weight
        out = weight.new_zeros((m, weight.shape[0]))
        for name, (nodes, feat) in features.items():
            out = out.index_copy(0, nodes.to(out.device), self.lins[name](feat))
        return out if self.heads is None else out.view(m, self.heads, self.out_dim)

    # -------------------------------------------------------------- raw features
    def _sequence(self, index: Tensor) -> Tensor:
        if self.kind == "sinusoidal":
            return sinusoidal_encoding(index, self.dim)
        return fourier_encoding(index, self.sequence_frequencies)

    def _grid(self, position: Tensor) -> Tensor:
        if self.kind == "sinusoidal":
            return grid_encoding(position, self.dim, kind="sinusoidal")
        return fourier_encoding(position, self.grid_frequencies)

    def _graph(self, tree, nodes: Tensor, device: torch.device) -> Tensor:
        local = torch.full((tree.num_nodes,), -1, dtype=torch.long, device=device)
        local[nodes] = torch.arange(nodes.numel(), device=device)
        edges = tree.sibling_edge_index.to(device)
        edges = local[edges] if edges.numel() else edges.new_zeros((2, 0))
        if edges.numel() and bool((edges < 0).any()):
            e = int((edges < 0).any(0).nonzero()[0])
            raise ValueError(f"sibling edge {tuple(tree.sibling_edge_index[:, e].tolist())} "
                             "is not between children of a 'graph' node")
        families = tree.structure_for(device).family_groups(nodes)
        if self.graph == "laplacian":
            return laplacian_encoding(edges, families, self.graph_dim)
        return random_walk_encoding(edges, families, self.graph_dim)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.out_dim}, heads={self.heads}, "
                f"dim={self.dim}, kind={self.kind!r}, graph={self.graph!r}, "
                f"graph_dim={self.graph_dim})")


# ----------------------------------------------------------------------- helpers
def _check_dim(dim: int, multiple: int, where: str) -> None:
    if not isinstance(dim, int) or dim < multiple or dim % multiple:
        raise ValueError(f"{where}: dim must be a positive multiple of {multiple}, got {dim!r}")


def _check_kind(kind: str) -> str:
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    return kind


def _as_positions(value, width: int, name: str) -> Tensor:
    value = torch.as_tensor(value)
    if value.dim() == 1 and width == 1:
        value = value.unsqueeze(-1)
    if value.dim() != 2 or value.shape[1] != width:
        expected = "[n]" if width == 1 else f"[n, {width}]"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(value.shape)}")
    if value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name} must be real numbers, got {value.dtype}")
    return value


def _check_tree(tree) -> None:
    for attr in ("geometry", "position", "edge_index"):
        if getattr(tree, attr, None) is None:
            raise TypeError(f"expected a NestedSignal (or a Batch of them) with "
                            f"'{attr}', got {type(tree).__name__}")


def _flat_keys(tree) -> List[Optional[str]]:
    """``tree.key`` as one list over all nodes (a ``Batch`` stores a list per tree)."""
    keys = tree.key if "key" in tree else None
    if keys is None:
        return [None] * tree.num_nodes
    if keys and isinstance(keys[0], (list, tuple)):
        keys = [key for per_tree in keys for key in per_tree]
    if len(keys) != tree.num_nodes:
        raise ValueError(f"tree.key has {len(keys)} entries for {tree.num_nodes} nodes")
    return list(keys)

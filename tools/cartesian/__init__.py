"""Irreducible Cartesian tensors and Cartesian-3j couplings (see ``closedloop.tools.cartesian_3j``)."""

from closedloop.tools.cartesian.basis import (MAX_RANK, casimir, generators, levi_civita, random_rotation,
                                              rank_of_size, rotate_tensor, standard_basis, weight_projectors,
                                              wigner_d)
from closedloop.tools.cartesian.coupling import (MAX_L, MAX_TOTAL, cartesian_3j, check_triangle, raw_coupling,
                                                 standard_3j)
from closedloop.tools.cartesian.decomposition import (Decomposition, IrreducibleCopy, change_of_basis,
                                                      coupling_paths, decompose, multiplicities)


def clear_caches() -> None:
    """Drop every cached basis, projector and 3j symbol (for cold-start timing or to free memory)."""
    from closedloop.tools.cartesian import basis, coupling, decomposition

    for fn in (basis._generators, basis._casimir, basis._weight_projectors, basis._standard_basis,
               coupling._standard_3j, coupling._cartesian_3j, decomposition._path_matrix):
        fn.cache_clear()


__all__ = [
    "clear_caches", "MAX_RANK", "MAX_L", "MAX_TOTAL", "casimir", "generators", "levi_civita", "random_rotation", "rank_of_size",
    "rotate_tensor", "standard_basis", "weight_projectors", "wigner_d", "cartesian_3j", "check_triangle",
    "raw_coupling", "standard_3j", "Decomposition", "IrreducibleCopy", "change_of_basis", "coupling_paths",
    "decompose", "multiplicities",
]

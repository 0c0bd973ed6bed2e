"""The kinds of ATen op the capture tells apart: views, permutes, softmaxes, reductions, norms,
splits, copies, and what an experts module may do with its weights and outputs."""


import torch

aten = torch.ops.aten


VIEWS = {
    aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.unsqueeze, aten.squeeze,
    aten.flatten, aten.unflatten, aten.view_as, aten.alias, aten.lift_fresh,
}
PERMUTES = {aten.t, aten.transpose, aten.permute, aten.numpy_T, aten.swapaxes, aten.movedim}
SOFTMAX = {aten._softmax, aten.softmax, aten._safe_softmax, aten._log_softmax, aten.log_softmax, aten.cumsum}
REDUCE_DIMS = {
    aten.mean, aten.sum, aten.amax, aten.amin, aten.var, aten.std, aten.var_mean, aten.std_mean,
    aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.max, aten.min, aten.argmax, aten.argmin, aten.any, aten.all,
    aten.prod,
}
NORMS = {aten.native_layer_norm, aten.layer_norm}
SPLITS = {aten.split, aten.split_with_sizes, aten.unsafe_split, aten.chunk, aten.unsafe_split_with_sizes}
ATTENTION_PREFIX = "_scaled_dot_product"
# What an experts module may do with its 3-D weights: take experts and views of them, and
# multiply them by activations (per expert, batched or grouped).
EXPERT_WEIGHT_VIEWS = {
    aten.select, aten.index, aten.index_select, aten.transpose, aten.t, aten.permute, aten.view, aten._unsafe_view,
    aten.reshape, aten.unsqueeze, aten.squeeze, aten.slice, aten.expand, aten.alias, aten.detach, aten._to_copy,
    aten.clone, aten.contiguous, aten.unbind, aten.lift_fresh,
}
EXPERT_WEIGHT_PRODUCTS = {aten.mm, aten.bmm, aten._grouped_mm, aten.addmm, aten.baddbmm, aten.matmul, aten.linear}
# Ops after an experts module's out projection that are linear in its (then partial) outputs:
# a sum over the ranks after them equals them applied to the sum.
PRODUCTS_OF_TWO = {aten.mul, aten.mul_, aten.div, aten.div_, aten.bmm, aten.mm, aten.matmul}
LINEAR_IN_PARTIAL_SUMS = EXPERT_WEIGHT_VIEWS | PRODUCTS_OF_TWO | {
    aten.index_add, aten.index_add_, aten.scatter_add, aten.scatter_add_, aten.index_put, aten.index_put_,
    aten.add, aten.add_, aten.sum, aten.cat, aten.stack, aten.copy_, aten.to, aten.neg, aten.zeros_like,
    aten.empty_like, aten.new_zeros, aten.masked_fill, aten.where, aten.split, aten.split_with_sizes, aten.chunk,
    aten.flatten, aten.unflatten, aten.as_strided, aten.view_as, aten.sub, aten.sub_, aten.narrow,
}
# Ops summing their tensor operands, or taking elements from each (cat, where): where one is a
# partial sum of the experts' outputs, every other must be one too, or zeros (a whole tensor added
# on every rank would be summed over the ranks with the partial sums: LongCat-Flash's
# zero-computation experts index_add their input beside the experts' products).
SUMS_OF_TERMS = {
    aten.add, aten.add_, aten.sub, aten.sub_, aten.index_add, aten.index_add_, aten.scatter_add, aten.scatter_add_,
    aten.index_put, aten.index_put_, aten.cat, aten.stack, aten.where,
}
ZERO_MAKERS = {aten.zeros, aten.zeros_like, aten.new_zeros}
# Ops whose output holds what their input holds: zeros stay zeros.
KEEP_VALUES = {aten.detach, aten.alias, aten.clone, aten._to_copy, aten.to, aten.contiguous, aten.view, aten.reshape,
               aten.expand, aten.unsqueeze, aten.squeeze, aten.t, aten.transpose, aten.permute}
COPIES = {
    aten.clone, aten._to_copy, aten.detach, aten.copy_, aten.native_dropout, aten.dropout, aten.contiguous,
    aten.where, aten.masked_fill, aten.type_as, aten.to,
    # In place on the scores (XLM's scores.masked_fill_(mask, min)): what masked_fill computes,
    # written back into the tensor it returns.
    aten.masked_fill_,
    # Tensors made "like" another (dropout masks) take its local shape, so they follow its layout.
    aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like,
    aten.bernoulli, aten.bernoulli_, aten.uniform_, aten.normal_, aten.fill_, aten.zero_,
}

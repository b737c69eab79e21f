// Flex combine across nodes (design.md §5.5, the reverse of the two hops): the forwarder of node
// m for home rank s reads, over shared memory, the terms of s's tokens from the ranks of m
// and sends them to s in one message (one network transfer per (token, node)).
//
// NOTE: fp32 addition is not associative, and design.md §4.1 folds acc = 0; acc += w_e * term_e
// over the experts in ascending order at the home rank. A node's partial sum over its own
// experts would change that order (it starts from 0, not from the home's running sum), so
// the forwarder ships per-expert terms instead: with ETP (P > 1) it reduces the P partial
// outputs of each expert inside the node (term_e = 0 + sum over p ascending, exactly the
// reference's term), a P-fold reduction of network bytes; with P = 1 the term is the raw
// row in its own dtype (no widening to fp32). The home rank then folds all terms in order.
// Tokens for which a chain of fp32 partials is smaller (chain_combine.cc) send no terms here.
#include <cstring>

#include "dispatch/flex/engines.h"

namespace moed::flex {

StatusOr<PullRemote> pull_remote_start(const DispatchContext& ctx, const PullSpec& spec, int tag) {
  const FlexHandle& h = *ctx.handle;
  const Topology& topo = h.topo;
  const int N = topo.num_nodes, P = topo.etp_size, C = h.send.num_channels;
  const int64_t H = h.hidden;
  PullRemote r;
  r.piece_bytes = P == 1 ? dtype_row_bytes(spec.dtype, H) : size_t(H) * sizeof(float);
  const size_t scalar_bytes = spec.with_scalars ? sizeof(float) : 0;
  // Tokens that chain (chain_combine.cc) send no terms.
  const uint32_t chain_bit = chain_enabled(topo, spec) ? 1u << chain_class(spec.dtype, P) : 0;
  const std::vector<int64_t>& terms =
      chain_bit ? h.send.term_entries[chain_class(spec.dtype, P)] : h.send.node_entries;
  r.send_buffers.resize(size_t(N));
  MOED_RETURN_IF_ERROR(post_node_recvs(
      *ctx.world, topo, *ctx.net, tag,
      [&](int m) { return size_t(terms[size_t(C) * N + m]) * (r.piece_bytes + scalar_bytes); },
      r.recv_buffers, r.recvs));
  uint64_t rows_read = 0;
  for (const ForwardPlan& f : h.forward) {
    // Piece index of each token's first term: its entries, less those of chained tokens.
    std::vector<int64_t> first(size_t(f.num_tokens) + 1, 0);
    for (int64_t i = 0; i < f.num_tokens; ++i) {
      const bool chained = (f.chain[size_t(i)].classes & chain_bit) != 0;
      first[size_t(i) + 1] =
          first[size_t(i)] +
          (chained ? 0 : f.entry_begin[size_t(i) + 1] - f.entry_begin[size_t(i)]);
    }
    const int64_t q = first[size_t(f.num_tokens)];
    if (q == 0) continue;
    const int m = topo.node_of_rank(f.src);
    // With P = 1 a term is an expert's row as it lies, sent from there (World::isend_gather);
    // the buffer holds the fp32 terms of P > 1 and the scalars.
    std::vector<const char*> raw(P == 1 ? size_t(q) : 0);
    const size_t built = P == 1 ? 0 : r.piece_bytes;
    Bytes& buf = r.send_buffers[size_t(m)];
    buf = ctx.net->send(m, size_t(q) * (built + scalar_bytes));
    char* scalars_out = buf.data() + size_t(q) * built;
    ctx.world->pool().parallel_for(
        f.num_tokens,
        [&](int64_t b, int64_t e, int) {
          for (int64_t i = b; i < e; ++i) {
            if (f.chain[size_t(i)].classes & chain_bit) continue;
            for (int64_t k = f.entry_begin[size_t(i)]; k < f.entry_begin[size_t(i) + 1]; ++k) {
              const int64_t out = first[size_t(i)] + (k - f.entry_begin[size_t(i)]);
              const int ex = f.entry_expert[size_t(k)];
              const int64_t row = f.entry_row[size_t(k)];
              float s = 0.0f;
              if (P == 1) {
                const PullSource& src =
                    spec.sources[size_t(topo.first_rank_of_expert(ex) % topo.ranks_per_node)];
                raw[size_t(out)] = src.rows + size_t(row) * src.row_stride_bytes;
                if (spec.with_scalars) s = s + src.scalars[row];
              } else {
                float* term = reinterpret_cast<float*>(buf.data() + size_t(out) * r.piece_bytes);
                std::memset(term, 0, r.piece_bytes);
                for (int p = 0; p < P; ++p) {
                  const PullSource& src = spec.sources[size_t((topo.first_rank_of_expert(ex) + p) %
                                                              topo.ranks_per_node)];
                  internal::row_kernels().accumulate(
                      term, src.rows + size_t(row) * src.row_stride_bytes, spec.dtype, size_t(H));
                  if (spec.with_scalars) s = s + src.scalars[row];
                }
              }
              if (spec.with_scalars)
                std::memcpy(scalars_out + size_t(out) * sizeof(float), &s, sizeof(s));
            }
          }
        },
        16);
    rows_read += uint64_t(q) * uint64_t(P);
    std::vector<World::Piece> pieces;
    for (const char* row : raw) add_piece(pieces, row, r.piece_bytes);
    add_piece(pieces, buf.data(), buf.size());
    MOED_RETURN_IF_ERROR(send_node_message(*ctx.world, f.src, tag, pieces, uint64_t(q), r.sends));
  }
  ctx.world->add_shared_bytes(rows_read * dtype_row_bytes(spec.dtype, H), rows_read);
  return r;
}

}  // namespace moed::flex

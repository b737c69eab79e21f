"""moed.deep_ep, DeepEP's Buffer on CPU: normal dispatch / combine and low-latency decode on 4
rank threads as 2 emulated nodes (python3 python/examples/deep_ep_example.py). Under mpirun,
call body(moed.init()) on every rank instead of moed.launch."""
import torch
import moed
import moed.deep_ep as deep_ep

def body(group, num_experts=8):
    torch.manual_seed(group.rank())
    x = torch.randn(256, 1024).to(torch.bfloat16)
    topk_idx = torch.randn(256, num_experts).topk(2).indices            # int64 = deep_ep.topk_idx_t
    topk_weights = torch.rand(256, 2)
    buffer = deep_ep.Buffer(group, int(1e9))                            # byte counts: recorded only
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = \
        buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                        num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert)
    y = recv_x * 2                                                      # the experts
    combined_x, combined_topk_weights, _ = buffer.combine(y, handle, topk_weights=recv_topk_weights)

    # Decode: fixed slots, FP8 on the way, receive when the hook runs.
    (recv_fp8, recv_scales), recv_count, ll_handle, _, hook = buffer.low_latency_dispatch(
        x[:32], topk_idx[:32], 32, num_experts, use_fp8=True, return_recv_hook=True)
    hook()
    y_ll = buffer.get_next_low_latency_combine_buffer(ll_handle)
    y_ll.fill_(1)                                                       # experts write here
    out, _, _ = buffer.low_latency_combine(y_ll, topk_idx[:32], topk_weights[:32], ll_handle,
                                           zero_copy=True)
    return combined_x.shape, out.shape

if __name__ == "__main__":
    print(moed.launch(body, 4, ranks_per_node=2))  # 4 rank threads as 2 nodes of 2

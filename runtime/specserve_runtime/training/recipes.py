"""The two drafter training recipes, as loss functions over one distilled sequence.

Both read the same data: the sequence's tokens (prompt + the target's own response) and the
target's tapped hidden states at every position. Both also return a teacher-forced
acceptance estimate: the data is the target's greedy output, so a draft is accepted exactly
when it equals the next data token, and the accepted-prefix length per drafting position is
what the engine would measure at that position.
"""

import math

import torch
import torch.nn.functional as F

from .. import blockquant
from ..drafters import Proposer, propose_all
from ..drafters.dflash import DFlashDrafter, draft_tree
from ..drafters.eagle3 import Eagle3Drafter
from ..drafters.vocab import IGNORE, DraftHead
from ..model import Transformer


def sample_anchors(response_start: int, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct, sorted anchor positions inside the response, each with a next token."""
    candidates = torch.arange(response_start, length - 1)
    if candidates.numel() == 0:
        return candidates
    chosen = torch.randperm(candidates.numel(), generator=generator)[:count]
    return candidates[chosen].sort().values


def block_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """[N*B, S + N*B] boolean: block j sees context positions < anchors[j], and its own B slots."""
    num_blocks = anchors.numel()
    block_of_query = torch.arange(num_blocks).repeat_interleave(block_size)  # [N*B]
    sees_context = torch.arange(context_length)[None, :] < anchors[block_of_query][:, None]  # [N*B, S]
    sees_block = block_of_query[:, None] == block_of_query[None, :]  # [N*B, N*B]
    return torch.cat([sees_context, sees_block], dim=1)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Slot k (1..B-1) weighs exp(-(k-1)/gamma): early slots decide acceptance, so they count most."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def token_losses(logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None) -> torch.Tensor:
    """Per-position loss: cross-entropy with the data token (the target's argmax), or, given the
    target's logits over the draft vocabulary, with its whole distribution (forward KL up to the
    target's entropy, a constant). The soft target also teaches which tokens come close, and it
    covers positions whose token the draft vocabulary lacks."""
    if teacher_logits is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
    return -(torch.softmax(teacher_logits, dim=-1) * torch.log_softmax(logits, dim=-1)).sum(-1)


def accepted_prefix(correct: torch.Tensor) -> torch.Tensor:
    """[..., K] booleans -> number of leading Trues."""
    return correct.int().cumprod(dim=-1).sum(dim=-1)


def tree_accepted(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Per anchor, the drafts accepted when its block's drafts are draft_tree(num_nodes) of its
    logits [N, B-1, V]: along an accepted branch the tokens are the data's, so the target's token
    after a draft at depth d is the data's label d + 1 (IGNORE, never a draft, where it has none)."""
    counts = []
    for anchor_logits, anchor_labels, anchor_valid in zip(logits, labels.tolist(), valid.tolist()):
        tree = draft_tree(*blockquant.top_log_probs(anchor_logits[:num_nodes], min(num_nodes, logits.shape[-1])),
                          num_nodes)
        depths = [0] + tree.depths  # of each row: 0 the anchor, 1 + i draft i
        label = [token if ok else IGNORE for token, ok in zip(anchor_labels, anchor_valid)] + [IGNORE]
        counts.append(len(tree.accepted(lambda row: label[depths[row]])))
    return torch.tensor(counts)


def proposer_accepted(proposer: Proposer, tokens: list[int], taps: torch.Tensor, response_start: int,
                      max_drafts: int) -> list[int]:
    """After each response token but the last (the positions of eagle3_loss's "accepted"), the drafts
    accepted when the engine's own `proposer` drafts there: given the data's tokens and the target's
    features of them, as in the engine at T=0, where the data is what the target commits. Along an
    accepted branch the target's token after a draft at depth d is the data's, d + 1 tokens on."""
    proposer.begin(len(tokens) + max_drafts + 1)
    accepted, fed = [], 0
    for position in range(response_start, len(tokens) - 1):
        proposer.extend_context(taps[fed:position])  # the target's features of every token but the last
        fed = position
        (drafts,) = propose_all(proposer, [(proposer, tokens[: position + 1], max_drafts)])
        depths = [0] + drafts.depths  # of each row: 0 the committed tokens, 1 + i draft i
        following = tokens[position + 1 :]
        accepted.append(len(drafts.accepted(lambda row: following[depths[row]] if depths[row] < len(following) else None)))
    return accepted


def engine_walk(accepted: list[int]) -> list[int]:
    """The drafts the engine accepts at each verify step through one response at T=0.

    `accepted[i]` is the accepted-prefix length of the drafts made after the response's i-th token
    (every position, in order). The data is the target's greedy output, so from there the engine
    keeps exactly those drafts and the target's own next token, and drafts next after position
    i + 1 + accepted[i]. Tokens per step along this walk is the acceptance length the engine
    measures. It differs from the mean over all positions (uniform anchors): the walk stops at
    every position where drafts fail and skips the positions inside accepted runs, which on real
    drafters puts it below that mean, though not for every sequence.
    """
    visited, position = [], 0
    while position < len(accepted):
        # As the engine at max_new_tokens: drafts stop one short of the end, leaving the target's token.
        kept = min(accepted[position], len(accepted) - 1 - position)
        visited.append(kept)
        position += 1 + kept
    return visited


def dflash_loss(
    drafter: DFlashDrafter,
    target: Transformer,
    head: DraftHead,
    tokens: torch.Tensor,  # [S]
    taps: torch.Tensor,  # [S, L*H]
    response_start: int,
    num_anchors: int,
    gamma: float,
    generator: torch.Generator,
    teacher: torch.Tensor | None = None,  # [S, H]: the target's normed last hidden states (logit targets)
    tree_nodes: int | None = None,  # evaluation: the drafts are each block's draft tree of this many nodes
) -> tuple[torch.Tensor, dict]:
    cfg = drafter.config
    length, size = tokens.shape[0], cfg.block_size
    anchors = sample_anchors(response_start, length, num_anchors, generator)  # [N]
    blocks = torch.full((anchors.numel(), size), cfg.mask_token_id)
    blocks[:, 0] = tokens[anchors]  # block = [anchor token, MASK x (B-1)]
    positions = anchors[:, None] + torch.arange(size)  # [N, B]
    context_kv = drafter.context_kv(taps, torch.arange(length))
    mask = block_mask(anchors, length, size)
    hidden = drafter(target.embed_tokens(blocks.flatten()), positions.flatten(), [context_kv], mask)
    hidden = hidden.view(anchors.numel(), size, -1)[:, 1:]  # slot k predicts the token k after the anchor
    label_positions = positions[:, 1:]
    valid = label_positions < length
    labels = head.to_draft(tokens[label_positions.clamp(max=length - 1)])  # IGNORE: not in the draft vocabulary
    logits = head.logits(hidden)  # [N, B-1, V_draft]
    # The target's distribution for the token at p comes from its hidden state at p - 1.
    teacher_logits = None if teacher is None else head.logits(teacher[(label_positions - 1).clamp(max=length - 1)])
    losses = token_losses(logits.flatten(0, 1), labels.flatten(),
                          None if teacher_logits is None else teacher_logits.flatten(0, 1))
    weights = position_weights(size, gamma)[None, :] * valid * ((labels != IGNORE) | (teacher is not None))
    loss = (losses.view_as(labels) * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        accepted = accepted_prefix(correct)  # per anchor; with every position as an anchor, engine_walk's input
        if tree_nodes is not None:
            accepted = tree_accepted(logits, labels, valid, tree_nodes)
        stats = {"accuracy": float(correct.float().sum() / valid.sum()), "tau": 1 + float(accepted.float().mean()),
                 "accepted": accepted.tolist()}
    return loss, stats


def eagle3_loss(
    drafter: Eagle3Drafter,
    target: Transformer,
    head: DraftHead,
    tokens: torch.Tensor,  # [S]
    taps: torch.Tensor,  # [S, L*H]
    response_start: int,
    depth: int,
    teacher: torch.Tensor | None = None,  # [S, H]: the target's normed last hidden states (logit targets)
) -> tuple[torch.Tensor, dict]:
    """Training-time test: unroll `depth` drafting steps exactly as the proposer runs them.

    Position j of step 1 pairs token j+1 with the target's feature f_j. Step d feeds token j+d
    and the drafter's own step d-1 output at j, and predicts token j+d+1. Its query (absolute
    position j+d-1) attends to the step-1 keys at positions <= j (the real context) and to the
    keys its own chain wrote at steps 2..d: the drafter cache's contents at inference time.
    """
    layer, attention = drafter.midlayer, drafter.midlayer.self_attn
    length = tokens.shape[0]
    positions = torch.arange(length - 1)  # j
    features = drafter.fc(taps[:-1])  # [T, H]
    causal = positions[None, :] <= positions[:, None]  # step-1 keys j' <= j
    chain_keys, chain_values = [], []
    total, weight_sum, correct_steps = 0.0, 0.0, []
    for step in range(1, depth + 1):
        token_positions = positions + step
        embeds = target.embed_tokens(tokens[token_positions.clamp(max=length - 1)])
        x = layer.fuse(embeds, features)
        cos, sin = drafter.rotary(positions + step - 1)
        q = attention.query(x, cos, sin)
        k, v = attention.key_value(x, cos, sin)
        if step == 1:
            base_k, base_v = k, v
        else:
            chain_keys.append(k)
            chain_values.append(v)
        attended = _chain_attention(q, base_k, base_v, causal, chain_keys, chain_values)
        features = layer.finish(features, attention.project_out(attended))
        label_positions = positions + step + 1
        valid = (label_positions < length) & (label_positions >= response_start)
        labels = head.to_draft(tokens[label_positions.clamp(max=length - 1)][valid])
        logits = head.logits(drafter.norm(features[valid]))
        teacher_logits = None if teacher is None else head.logits(teacher[(label_positions - 1)[valid]])
        weight = 0.8 ** (step - 1)
        known = labels.numel() if teacher is not None else int((labels != IGNORE).sum())
        total = total + weight * token_losses(logits, labels, teacher_logits).sum() / max(known, 1)
        weight_sum += weight
        step_correct = torch.zeros_like(valid)
        step_correct[valid] = logits.argmax(-1) == labels
        correct_steps.append(step_correct)
    with torch.no_grad():
        correct = torch.stack(correct_steps, dim=-1)  # [T, depth]
        starts = (positions + 2 >= response_start) & (positions + depth + 1 < length)
        stats = {
            "accuracy": float(correct_steps[0].float().sum() / max(int(starts.sum()), 1)),
            "tau": 1 + float(accepted_prefix(correct[starts]).float().mean()) if starts.any() else 1.0,
            # After response token i (position response_start + i) the proposer drafts from that token
            # and the feature of the position before it: the chain of row j = response_start + i - 1.
            "accepted": accepted_prefix(correct[response_start - 1 : length - 2]).tolist(),
        }
    return total / weight_sum, stats


def _chain_attention(q, base_k, base_v, causal, chain_keys, chain_values):
    """Softmax over [step-1 keys (causal) ; this position's chain keys], grouped-query heads."""
    groups = q.shape[1] // base_k.shape[1]
    expand = lambda t: t.repeat_interleave(groups, dim=1)  # noqa: E731
    scale = 1 / math.sqrt(q.shape[-1])
    scores = [(q @ expand(base_k).transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]  # [1,h,T,T]
    scores += [(q * expand(k)).sum(-1, keepdim=True) * scale for k in chain_keys]  # [1,h,T,1] each
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    length = base_k.shape[2]
    out = probs[..., :length] @ expand(base_v)
    for i, v in enumerate(chain_values):
        out = out + probs[..., length + i : length + i + 1] * expand(v)
    return out

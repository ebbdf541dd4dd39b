"""The rotary encoders whose models hold their layers themselves: ModernBERT, NomicBERT, EuroBERT.

  * ModernBERT (pre-norm): attn_norm, attn.{Wqkv,Wo,out_drop}, mlp_norm, mlp.{Wi,act,drop,Wo}, held by the model
    in `layers` beside `embeddings`, `final_norm` and `rotary_emb`;
  * NomicBERT (post-norm, no biases) and EuroBERT (pre-norm RMSNorm, grouped-query heads, its model holding
    `embed_tokens`): self_attn.{q_proj,k_proj,v_proj,o_proj}, mlp.{gate_proj,up_proj,down_proj,act_fn}, and
    post_attention_layernorm with post_mlp_layernorm (NomicBERT) or input_layernorm (EuroBERT).
Each model is fused whole (`Layers.encoder_forward`: `_rotary_model_run`). q and k are rotated by each token's
position id (`kernels.rotary`, cos and sin in the kernel) with its layer type's inv_freq and scaling; ModernBERT's
local layers attend within sliding_window positions each side (the varlen kernel's window, the tiles outside
skipped); k and v keep their num_key_value_heads heads in the kernel; the gated MLP's act(a) * b is one kernel
(`kernels.glu`); each residual add before a pre-norm is in that norm's kernel (`return_sum`), and each
EuroBertRMSNorm runs the RMSNorm kernel. A rope type whose frequencies change with the length, or a rotation
narrower than the head, keeps the original attention.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from bertfuse.bert.data.batch import Packed
from bertfuse.bert.hf.compute import (_add_norm, _add_then_norm, _forward_parameters, _gate, _linear_gelu, _original,
                                      _rms_norm_forward, _unique)
from bertfuse.bert.hf.records import (GLOBAL, MODEL_LAYERS, Family, FamilyNorm, GeluBlock, Group, Layers, MLMHead,
                                      Rotary)
from bertfuse.bert.hf.encoder import (_call_layout, _EncoderState, _holes, _original_code_reason, _padded,
                                      _run_original, _run_stack, _wants_hidden_states, _with_recording)
from bertfuse.bert.masks import packed_rows
from bertfuse.bert.model import ops
from bertfuse.bert.model.padding import unpad


def _nomicbert_head_transform_forward(self, hidden_states):
    """NomicBertPredictionHeadTransform: layer_norm(transform_act_fn(dense(x)))."""
    return self.layer_norm(_linear_gelu(self.dense, self.transform_act_fn, hidden_states))


def _layer_type(attention) -> str:
    types = getattr(attention.config, "layer_types", None)
    return types[attention.layer_idx] if types else GLOBAL


def _rotary_attention(self, x, q, k, v, packed, position):
    """The context [tokens, heads * head_dim] of q [tokens, heads, head_dim] and k, v [tokens, kv_heads,
    head_dim] rotated by the layer type's rotation, within its window; the dropout on the probabilities in the
    kernel."""
    # ModernBERT before transformers 5.1 keys them by the attention module itself (`_own_rope_positions`)
    backend, kind = ops.backend_for(x), self if self in position.rotations else _layer_type(self)
    q, k = (ops.rotary(t, position.positions, position.rotations[kind], backend) for t in (q, k))
    context = ops.varlen_attention(q, k, v, packed, self.attention_dropout if self.training else 0.0,
                                   backend, window_size=position.windows[kind])
    return context.flatten(1)


def _split_heads(t: torch.Tensor, head_dim: int, parts: int = 1) -> torch.Tensor:
    """[tokens, parts * heads * head_dim] -> [tokens, (parts,) heads, head_dim], by sizes (no -1: a call may pack
    no token at all)."""
    heads = t.shape[-1] // (parts * head_dim)
    return t.view(t.shape[0], parts, heads, head_dim) if parts > 1 else t.view(t.shape[0], heads, head_dim)


def _modernbert_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """ModernBertAttention: out_drop(Wo(attention of RoPE(q), RoPE(k), v)), its layer type's rotation and window
    (a local layer sees sliding_window positions each side)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    x = hidden_states
    q, k, v = _split_heads(self.Wqkv(x), self.head_dim, 3).unbind(1)
    return self.out_drop(self.Wo(_rotary_attention(self, x, q, k, v, packed, position))), None


def _projected_attention_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """NomicBertAttention, EuroBertAttention: o_proj(attention of RoPE(q_proj(x)), RoPE(k_proj(x)), v_proj(x)),
    k and v with num_key_value_heads heads (grouped-query attention: the kernel reads each k/v head for its
    group, never repeated in memory)."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    x, d = hidden_states, self.head_dim
    q, k, v = (_split_heads(proj(x), d) for proj in (self.q_proj, self.k_proj, self.v_proj))
    return self.o_proj(_rotary_attention(self, x, q, k, v, packed, position)), None


def _pre_norm_layer(x, attention, attention_norm, mlp_norm, mlp, packed, position):
    """a = x + attention(attention_norm(x)); a + mlp(mlp_norm(a)), the residual add and mlp_norm in one kernel."""
    attended, _ = attention(attention_norm(x), packed=packed, position=position)
    normed, total = _add_then_norm(mlp_norm, attended, x)
    return total + mlp(normed)


def _modernbert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """ModernBertEncoderLayer: pre-norm (`_pre_norm_layer`), LayerNorms attn_norm and mlp_norm."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return _pre_norm_layer(hidden_states, self.attn, self.attn_norm, self.mlp_norm, self.mlp, packed, position)


def _eurobert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """EuroBertDecoderLayer (bidirectional): pre-norm (`_pre_norm_layer`), RMSNorms input_layernorm and
    post_attention_layernorm."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    return _pre_norm_layer(hidden_states, self.self_attn, self.input_layernorm, self.post_attention_layernorm,
                           self.mlp, packed, position)


def _nomicbert_layer_forward(self, hidden_states, *args, packed=None, position=None, **kwargs):
    """NomicBertLayer (post-norm): a = post_attention_layernorm(x + dropout(self_attn(x)));
    post_mlp_layernorm(a + dropout(mlp(a))), each dropout, add and LayerNorm in one kernel."""
    if packed is None:
        return _original(self).forward(hidden_states, *args, **kwargs)
    attended, _ = self.self_attn(hidden_states, packed=packed, position=position)
    x = _add_norm(self.post_attention_layernorm, self.post_attention_dropout, attended, hidden_states)
    return _add_norm(self.post_mlp_layernorm, self.post_mlp_dropout, self.mlp(x), x)


def _gated_mlp_forward(self, hidden_states):
    """ModernBertMLP: Wo(drop(act(a) * b)) for (a, b) the halves of Wi(x); the gating in one kernel."""
    a, b = self.Wi(hidden_states).chunk(2, dim=-1)
    return self.Wo(self.drop(_gate(self.act, a, b)))


def _gate_up_mlp_forward(self, x):
    """NomicBertMLP, EuroBertMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); the gating in one kernel."""
    return self.down_proj(_gate(self.act_fn, self.gate_proj(x), self.up_proj(x)))


def _rope_parameters(emb) -> dict:
    """layer type -> (rope type, inv_freq, attention scaling) of a model's rotary embedding module, as its forward
    reads them: ModernBERT's per layer type, the others' one set."""
    if isinstance(emb.rope_type, dict):
        return {k: (t, getattr(emb, f"{k}_inv_freq", None), getattr(emb, f"{k}_attention_scaling", None))
                for k, t in emb.rope_type.items()}
    return {GLOBAL: (emb.rope_type, emb.inv_freq, emb.attention_scaling)}


def _rope_positions(model, positions, windowed: bool = True) -> Rotary:
    """The rotations of each layer type from the model's rotary embedding module, and the windows its config
    sets (ModernBERT's local layers: sliding_window positions each side; none where not `windowed`: a 4-D mask
    given to the model is every layer's mask, the windows' masks never built)."""
    if _modernbert_before_5_1(model):
        return _own_rope_positions(model, positions, windowed)
    rotations, windows = {}, {}
    for kind, (_, inv_freq, scaling) in _rope_parameters(model.rotary_emb).items():
        rotations[kind] = ops.Rotation(inv_freq.float(), float(scaling))
        local = windowed and kind == "sliding_attention"
        windows[kind] = (model.config.sliding_window,) * 2 if local else (-1, -1)
    return Rotary(positions, rotations, windows)


# ---- ModernBERT before transformers 5.1: its model takes sliding_window_mask, builds the masks from a 2-D one,
# and each attention knows its window (`local_attention`, half the configured width each side) and its layer
# (`layer_id`); its rotation is each attention's own `rotary_emb` (4.57), or the model's per layer type (5.0).
def _modernbert_before_5_1(model) -> bool:
    return "sliding_window_mask" in _forward_parameters(type(model))


def _own_rope_parameters(model) -> dict:
    """attention module -> (rope type, inv_freq, attention scaling) its code rotates by."""
    shared = _rope_parameters(model.rotary_emb) if getattr(model, "rotary_emb", None) is not None else None
    found = {}
    for layer in model.layers:
        attention = layer.attn
        if shared is not None:
            found[attention] = shared.get(model.config.layer_types[attention.layer_id], (None, None, None))
        else:
            own = attention.rotary_emb  # flash_attention_2's unpadded rotary has no rope type: refused
            found[attention] = (getattr(own, "rope_type", None), getattr(own, "inv_freq", None),
                                getattr(own, "attention_scaling", None))
    return found


def _own_rope_positions(model, positions, windowed: bool) -> Rotary:
    rotations, windows = {}, {}
    for attention, (_, inv_freq, scaling) in _own_rope_parameters(model).items():
        rotations[attention] = ops.Rotation(inv_freq.float(), float(scaling))
        windows[attention] = tuple(attention.local_attention) if windowed else (-1, -1)
    return Rotary(positions, rotations, windows)


def _own_rope_problems(model) -> list[str]:
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    params = _own_rope_parameters(model).values()
    why = _unique(f"rope type {t!r}, whose frequencies change with the length" for t, f, _ in params
                  if f is not None and t not in STATIC_ROPE)
    if any(f is None for _, f, _ in params):
        why += ("flash_attention_2's own rotation on unpadded tokens",)
    why += _unique(w for _, f, _ in params if f is not None for w in _rotary_width_problem(f, head_dim))
    return list(why)


def _own_mask_problem(mask) -> str | None:
    """This code reads a 2-D mask as 1 = attend, anything else masked (`1 - mask` nonzero), and raises for any
    other rank: a 2-D mask of 0s and 1s is what the fused attention reads (nonzero = attend); any other runs the
    original code (one sync)."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(((mask == 0) | (mask == 1)).all()):
        return None
    return "an attention mask other than a 2-D one of 0s and 1s, which this release's ModernBERT reads its own way"


def _modernbert_problems(model) -> list[str]:
    """`_rope_problems`; before transformers 5.1, each attention's own rotation where the model has none, and
    not flash attention (whose code there unpads and rotates by its own positions: transformers 5.1 on)."""
    why = _rope_problems(model) if getattr(model, "rotary_emb", None) is not None else _own_rope_problems(model)
    flash = (getattr(model.config, "_attn_implementation", None) or "").startswith("flash")
    if flash and _modernbert_before_5_1(model):
        why.append("flash attention in this release's ModernBERT, which unpads and rotates by its own positions "
                   "(fused on transformers 5.1 and newer)")
    return why


class _ModelCall(NamedTuple):
    """One call of a rotary model fused whole, as its own forward was given it."""
    given: torch.Tensor | None     # input_ids, or inputs_embeds where those are given instead
    both_or_neither: bool          # input_ids and inputs_embeds both given, or neither: the original code raises
    attention_mask: object
    position_ids: torch.Tensor | None
    kwargs: dict
    embed: Callable                # () -> [batch, seq, hidden]: the embeddings as the model's code computes them
    original: Callable             # () -> the original forward's output


def _rotary_model_run(self, call: _ModelCall, final_norm: str | None):
    """A rotary model fused whole: the embeddings as its code runs them, padding removed once, every layer on
    packed tokens (RoPE by each token's position id, local layers' windows inside the attention kernel), the
    final norm (`final_norm`, None: none), padding restored (as 0), the pooler where the model has one. A call
    the fused layers do not compute runs the original code, counted in fuse_report."""
    state: _EncoderState = self._bertfuse_encoder
    as_tuple = call.kwargs.get("return_dict", getattr(self.config, "return_dict", True)) is False
    mask = call.attention_mask
    # transformers' mask functions take a 2-D mask, or a 4-D one as it is (for every layer, windows or not), and
    # raise for other ranks: the original code runs for those, as for inputs it refuses.
    if call.both_or_neither or isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() not in (2, 4)):
        return _run_original(state, "inputs or masks given as the original code alone reads them", call.original)
    batch, seqlen = call.given.shape[:2]
    # The model's own mask and attention read no position ids (its code builds the mask from attention_mask
    # alone): only a flash call's cu_seq_lens split a row.
    rows = packed_rows(self.config, mask, call.kwargs, None, batch, seqlen, call.given.device)
    windowed = not (isinstance(mask, torch.Tensor) and mask.dim() == 4)
    why = rows.why or _original_code_reason(self, state, rows.keys, None, call.kwargs, windowed, rows.segments)
    every = _wants_hidden_states(state, call.kwargs)
    p = None if why else _call_layout(self, state, rows, every)
    if not isinstance(p, Packed):
        return _run_original(state, why or p, call.original)
    from transformers import modeling_outputs as outputs

    ids = torch.arange(seqlen, device=call.given.device) if call.position_ids is None else call.position_ids
    position = _rope_positions(self, unpad(ids.expand(batch, seqlen), p), windowed)

    def run(model, **_):
        x, states = _run_stack(self, state, call.embed(), p, position, every)
        out = _padded(x if final_norm is None else getattr(self, final_norm)(x), p, rows.keys, every)
        fields = {"last_hidden_state": out, "hidden_states": states}
        if getattr(self, "pooler", None) is not None:
            fields["pooler_output"] = self.pooler(out)
        return getattr(outputs, state.layers.output)(**fields)

    # transformers 5 records the hidden states around the model's forward, which the fused one replaces: its
    # recording code runs around this one.
    recording = _with_recording(type(self), run) if every else None
    if recording is not None:
        return recording(self, **call.kwargs)
    result = run(self)
    return result.to_tuple() if as_tuple else result


def _modernbert_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                              **kwargs):
    """ModernBertModel fused whole (`_rotary_model_run`), final_norm after the layers."""
    def original():
        return _original(self).forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, **kwargs)

    def embed():
        return self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)

    if _modernbert_before_5_1(self) and (why := _own_mask_problem(attention_mask)):
        return _run_original(self._bertfuse_encoder, why, original)
    call = _ModelCall(input_ids if input_ids is not None else inputs_embeds, (input_ids is None) == (inputs_embeds
                      is None), attention_mask, position_ids, kwargs, embed, original)
    return _rotary_model_run(self, call, "final_norm")


def _nomicbert_model_forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                             inputs_embeds=None, **kwargs):
    """NomicBertModel fused whole (`_rotary_model_run`): post-norm layers, no final norm, its pooler if any."""
    def original():
        return _original(self).forward(input_ids=input_ids, attention_mask=attention_mask,
                                       token_type_ids=token_type_ids, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, **kwargs)

    def embed():  # with the position ids its code fills in (its embeddings before 5.17 read them)
        given = input_ids if input_ids is not None else inputs_embeds
        ids = torch.arange(given.shape[1], device=given.device)[None, :] if position_ids is None else position_ids
        return self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=ids,
                               inputs_embeds=inputs_embeds)

    call = _ModelCall(input_ids if input_ids is not None else inputs_embeds, (input_ids is None) == (inputs_embeds
                      is None), attention_mask, position_ids, kwargs, embed, original)
    return _rotary_model_run(self, call, None)


def _eurobert_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                            **kwargs):
    """EuroBertModel fused whole (`_rotary_model_run`): embed_tokens, pre-norm layers, the final RMSNorm `norm`."""
    def original():
        return _original(self).forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, **kwargs)

    def embed():
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    call = _ModelCall(input_ids if input_ids is not None else inputs_embeds, (input_ids is None) == (inputs_embeds
                      is None), attention_mask, position_ids, kwargs, embed, original)
    return _rotary_model_run(self, call, "norm")


def _prediction_head_forward(self, hidden_states):
    """ModernBertPredictionHead: norm(act(dense(x)))."""
    return self.norm(_linear_gelu(self.dense, self.act, hidden_states))


_MODERNBERT_MODELS = (("modernbert.modeling_modernbert", "ModernBert"),)

_NOMICBERT_MODELS = (("nomic_bert.modeling_nomic_bert", "NomicBert"),)

_EUROBERT_MODELS = (("eurobert.modeling_eurobert", "EuroBert"),)

_ROTARY_MODELS = (*_MODERNBERT_MODELS, *_NOMICBERT_MODELS, *_EUROBERT_MODELS)

_RMS_NORM_CLASSES = ("{P}RMSNorm",)  # weight * x / sqrt(mean(x^2) + variance_epsilon)

# Rope types whose inv_freq and scaling are fixed at construction (a dynamic one changes them with the length).
# ("proportional": zero frequencies past the rotated share, which rotate by nothing.)
STATIC_ROPE = ("default", "linear", "yarn", "llama3", "proportional")


def _rotary_width_problem(inv_freq, head_dim: int) -> list[str]:
    """[why] where the rotation is not over the whole head in pairs (the kernels' rotation): an odd head_dim, whose
    1-wide head transformers broadcasts against 2-wide cos and sin (and raises for wider ones), or frequencies
    for part of the head (partial_rotary_factor < 1), where transformers' code raises."""
    width = 2 * inv_freq.numel()
    if width == head_dim:
        return []
    return [f"a rotation {width} wide for head_dim {head_dim}, which the fused kernels do not compute (they rotate "
            "the whole head in pairs)"]


def _rope_problems(model) -> list[str]:
    """Why a rotary model's configuration asks for what the fused layers do not compute: a layer type other than
    global and local attention, a rope type whose frequencies change with the length, a rotation not as wide as
    the head, a layer count other than the layers held (NomicBERT and EuroBERT run the first num_hidden_layers of
    them)."""
    cfg, params = model.config, _rope_parameters(model.rotary_emb)
    kinds = set(getattr(cfg, "layer_types", None) or [GLOBAL])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    why = [f"layer type {k!r}" for k in sorted(kinds - {GLOBAL, "sliding_attention"})]
    why += [f"rope type {t!r}, whose frequencies change with the length" for k, (t, _, _) in sorted(params.items())
            if t not in STATIC_ROPE]
    why += [f"no rotary parameters for layer type {k!r}" for k in sorted(kinds)
            if k not in params or params[k][1] is None]
    why += _unique(w for _, inv_freq, _ in params.values() if inv_freq is not None
                   for w in _rotary_width_problem(inv_freq, head_dim))
    if len(model.layers) != cfg.num_hidden_layers:
        why.append(f"{len(model.layers)} layers held for num_hidden_layers={cfg.num_hidden_layers}")
    return why


def _modernbert_windows(encoder) -> list[tuple[int, int]]:
    """The (left, right) windows its local layers attend within (which count positions within a sequence)."""
    if _modernbert_before_5_1(encoder):
        return list({tuple(layer.attn.local_attention) for layer in encoder.layers} - {(-1, -1)})
    local = "sliding_attention" in encoder.config.layer_types
    return [(encoder.config.sliding_window,) * 2] if local else []


def _modernbert_call_problems(encoder, keys) -> list[str]:
    """Local layers' windows count positions within the packed sequence; the original code, padded slots too."""
    return _holes(keys, "sliding windows") if _modernbert_windows(encoder) else []


_ROTARY_FUSED = "attention (varlen, padding removed once; RoPE by each token's position id in the kernels{}), the " \
                "gated MLP's act(a) * b in one kernel, {}"

MODERNBERT_LAYERS = Layers("modernbert", ("attn_norm", "attn.Wqkv", "attn.Wo", "mlp_norm", "mlp.Wi", "mlp.Wo"),
                           "attn", (("", _modernbert_layer_forward), ("attn", _modernbert_attention_forward),
                                    ("mlp", _gated_mlp_forward)),
                           "BaseModelOutput",
                           (("attn", ("{P}Attention",)), ("", ("{P}EncoderLayer",)), ("..", ("{P}Model",)),
                            ("mlp", ("{P}MLP",))), _MODERNBERT_MODELS, stack=MODEL_LAYERS,
                           probs_dropout="attention_dropout", encoder_forward=_modernbert_model_forward,
                           problems=_modernbert_problems, call_problems=_modernbert_call_problems,
                           windows=_modernbert_windows,
                           # the shape its task models pass before transformers 5.1, read by flash attention's
                           # repadding only (flash is refused there)
                           reads=("batch_size", "seq_len"),
                           fused=_ROTARY_FUSED.format(", local windows skipping the tiles outside them",
                                                      "each residual add before mlp_norm in its LayerNorm kernel"))

_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")

NOMICBERT_LAYERS = Layers("nomicbert", (*_PROJECTIONS, "post_attention_layernorm", "post_mlp_layernorm"),
                          "self_attn", (("", _nomicbert_layer_forward), ("self_attn", _projected_attention_forward),
                                        ("mlp", _gate_up_mlp_forward)),
                          "BaseModelOutputWithPooling",
                          (("self_attn", ("{P}Attention",)), ("", ("{P}Layer",)), ("..", ("{P}Model",)),
                           ("mlp", ("{P}MLP",))), _NOMICBERT_MODELS, stack=MODEL_LAYERS,
                          probs_dropout="attention_dropout", encoder_forward=_nomicbert_model_forward,
                          problems=_rope_problems,
                          fused=_ROTARY_FUSED.format("", "each dropout + residual add in its LayerNorm kernel"))

EUROBERT_LAYERS = Layers("eurobert", (*_PROJECTIONS, "input_layernorm", "post_attention_layernorm"),
                         "self_attn", (("", _eurobert_layer_forward), ("self_attn", _projected_attention_forward),
                                       ("mlp", _gate_up_mlp_forward)),
                         "BaseModelOutput",
                         (("self_attn", ("{P}Attention",)), ("", ("{P}DecoderLayer",)), ("..", ("{P}Model",)),
                          ("mlp", ("{P}MLP",))), _EUROBERT_MODELS, stack=MODEL_LAYERS,
                         probs_dropout="attention_dropout", encoder_forward=_eurobert_model_forward,
                         problems=_rope_problems,
                         fused=_ROTARY_FUSED.format(", grouped-query heads read per group",
                                                    "every RMSNorm a kernel, each residual add before "
                                                    "post_attention_layernorm in its kernel"))

GROUP = Group(
    families=(
        # Two layers: the first global, the second local (a window of 4 each side, narrower than the test batch).
        Family("modernbert", "ModernBert", MODERNBERT_LAYERS, MLMHead("head.dense", "head.act", "head.norm", "decoder"),
               0, config_names=(("attention_probs_dropout_prob", "attention_dropout"),
                                ("hidden_dropout_prob", "mlp_dropout"), ("hidden_act", "hidden_activation")),
               test_config=(("local_attention", 8), ("global_attn_every_n_layers", 2), ("bos_token_id", 1),
                            ("eos_token_id", 2), ("cls_token_id", 1), ("sep_token_id", 2)), segments=False),
        # GeLU in the test models (SiLU by default): the head transform's Linear + GeLU fused too.
        Family("nomicbert", "NomicBert", NOMICBERT_LAYERS,
               MLMHead("cls.predictions.transform.dense", "cls.predictions.transform.transform_act_fn",
                       "cls.predictions.transform.layer_norm", "cls.predictions.decoder"), 0,
               test_config=(("hidden_act", "gelu"),)),
        # Two k/v heads for four query heads (grouped-query attention); the MLM head is the decoder alone.
        Family("eurobert", "EuroBert", EUROBERT_LAYERS, MLMHead(None, None, None, "lm_head"), 0,
               config_names=(("attention_probs_dropout_prob", "attention_dropout"),),
               test_config=(("num_key_value_heads", 2), ("bos_token_id", 1), ("eos_token_id", 2),
                            ("mask_token_id", 4)), segments=False)),
    gelu_blocks=(GeluBlock("{P}PredictionHead", ("dense", "act", "norm"), _prediction_head_forward),
                 GeluBlock("{P}PredictionHeadTransform", ("dense", "transform_act_fn", "layer_norm"),
                           _nomicbert_head_transform_forward)),
    norms=(FamilyNorm(_RMS_NORM_CLASSES, _ROTARY_MODELS, _rms_norm_forward, rms=True),))

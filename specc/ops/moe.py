"""Mixture of experts (Megatron Core's MoELayer): a top-k router, routed experts (each an MLP,
gated or not) that the tokens reach through an all-to-all dispatch over the expert-parallel
ranks and leave through an all-to-all combine, and optional shared experts every token passes.

Layouts on tp are those of a dense MLP's column + row pair: the op takes its tokens as R (the
compiler all-gathers them with sequence parallelism, or copies them in) and returns partial sums
P (the compiler reduces or reduce-scatters them), with every expert sharded over TP (expert
tensor parallelism equals tensor parallelism). On cp it is token-wise. Expert parallelism is not a
layout axis: EP ranks are data-parallel ranks, each holding its own tokens, and only this op moves
tokens between them; its all-to-alls are declared below (collectives), shown in the plan per
layer, and named by a comment on its line in the generated code."""

from __future__ import annotations

import math

from ..errors import SpecError
from .activations import ACTIVATIONS, is_gated
from .base import Attr, HFKnob, LayoutRule, OpKind, Weight, need_divisible, numel


class MoE(OpKind):
    name = "moe"
    doc = ("Routed experts: top-k router (softmax or sigmoid scores, load-balancing and z losses, bias "
           "balancing), all-to-all token dispatch over the expert-parallel ranks, grouped expert MLPs, "
           "weighted combine; optional shared experts. Takes R on tp, returns P.")
    attrs = (
        Attr("hidden_size", "int", required=True, minimum=1),
        Attr("num_experts", "int", required=True, minimum=1, doc="routed experts (Megatron --num-experts)"),
        Attr("ffn_hidden_size", "int", required=True, minimum=1, doc="each expert's MLP width (--moe-ffn-hidden-size)"),
        Attr("topk", "int", default=2, minimum=1, doc="experts per token (--moe-router-topk)"),
        Attr("activation", "str", default="swiglu", choices=tuple(ACTIVATIONS),
             doc="swiglu (or any gated activation): [gate | up] experts"),
        Attr("score_function", "str", default="softmax", choices=("softmax", "sigmoid"),
             doc="router scores (--moe-router-score-function)"),
        Attr("topk_renorm", "bool", default=False, doc="rescale the top-k weights to sum to 1 (Mixtral: true)"),
        Attr("topk_scaling_factor", "float", default=1.0, minimum=0.0,
             doc="multiplies the top-k weights, after renormalizing (--moe-router-topk-scaling-factor; "
                 "DeepSeek-V3's routed_scaling_factor)"),
        Attr("num_groups", "int", default=1, minimum=1,
             doc="group-limited routing: experts in this many groups (--moe-router-num-groups; HF n_group)"),
        Attr("group_topk", "int", default=1, minimum=1,
             doc="groups each token may route to, those whose topk / group_topk best scores sum highest "
                 "(--moe-router-group-topk; HF topk_group)"),
        Attr("load_balancing_type", "str", default="aux_loss", choices=("aux_loss", "none"),
             doc="--moe-router-load-balancing-type"),
        Attr("aux_loss_coeff", "float", default=0.0, minimum=0.0, doc="load-balancing loss weight (--moe-aux-loss-coeff)"),
        Attr("z_loss_coeff", "float", default=0.0, minimum=0.0, doc="router z-loss weight (--moe-z-loss-coeff)"),
        Attr("expert_bias", "bool", default=False,
             doc="DeepSeek-V3 balancing without an auxiliary loss (--moe-router-enable-expert-bias): a per-expert "
                 "bias added to the scores for the choice only, moved after each step, saved and imported "
                 "(HF e_score_correction_bias)"),
        Attr("expert_bias_update_rate", "float", default=1e-3, minimum=0.0, doc="--moe-router-bias-update-rate"),
        Attr("capacity_factor", "float", default=0.0, minimum=0.0,
             doc="0: dropless (default); else drop tokens past capacity (--moe-expert-capacity-factor)"),
        Attr("shared_expert_size", "int", default=0, minimum=0,
             doc="shared experts' MLP width, 0 for none (--moe-shared-expert-intermediate-size)"),
        Attr("shared_expert_gate", "bool", default=False, doc="scale the shared experts by sigmoid(x w) (Qwen2-MoE)"),
        Attr("apply_probs_on_input", "bool", default=False,
             doc="the routing weight scales the token each expert receives, not the expert's output (Llama 4; "
                 "--moe-apply-probs-on-input); topk 1 only"),
        Attr("grouped_gemm", "bool", default=True, doc="one batched GEMM per projection over the local experts"),
        Attr("init_std", "float", default=0.02, minimum=0.0),
    )

    def check(self, attrs, locs, ctx):
        if attrs["topk"] > attrs["num_experts"]:
            raise SpecError(locs.get("topk"), f"topk={attrs['topk']} exceeds num_experts={attrs['num_experts']}")
        if attrs["apply_probs_on_input"] and attrs["topk"] != 1:
            raise SpecError(locs.get("apply_probs_on_input"), f"apply_probs_on_input needs topk 1, got topk="
                            f"{attrs['topk']}", "a token scaled once goes to one expert (Megatron asserts the same)")
        ep = getattr(ctx, "ep", 1)
        need_divisible(attrs["num_experts"], ep, "num_experts", locs.get("num_experts"), axis="ep")
        e, g, gk, k = attrs["num_experts"], attrs["num_groups"], attrs["group_topk"], attrs["topk"]
        if g > 1:
            if e % g:
                raise SpecError(locs.get("num_groups"), f"num_experts={e} is not divisible by num_groups={g}")
            if gk > g or k % gk or k // gk > e // g:
                raise SpecError(locs.get("group_topk"), f"group_topk={gk} must be at most num_groups={g} and divide "
                                f"topk={k} into at most {e // g} experts per group")
        need_divisible(attrs["ffn_hidden_size"], ctx.tp, "ffn_hidden_size", locs.get("ffn_hidden_size"))
        need_divisible(attrs["shared_expert_size"], ctx.tp, "shared_expert_size", locs.get("shared_expert_size"))
        if attrs["shared_expert_gate"] and not attrs["shared_expert_size"]:
            raise SpecError(locs.get("shared_expert_gate"), "shared_expert_gate needs shared experts",
                            "set shared_expert_size")

    def out_shapes(self, attrs, shapes, fail):
        x = shapes[0]
        if not x or x[-1] != attrs["hidden_size"]:
            fail(f"input has last dim {x[-1] if x else None}, expected hidden_size={attrs['hidden_size']}")
        return [x]

    def weights(self, attrs):
        e, h, f = attrs["num_experts"], attrs["hidden_size"], attrs["ffn_hidden_size"]
        gated = is_gated(attrs["activation"])
        out = [Weight("router.weight", (e, h), "normal")]
        if attrs["expert_bias"]:  # no gradient: moved by the token counts after each step
            out.append(Weight("router.expert_bias", (e,), "zeros"))
        out += [Weight("experts.linear_fc1.weight", (e, 2 * f if gated else f, h), "normal", 1,
                       (f, f) if gated else (), expert_dim=0),
                Weight("experts.linear_fc2.weight", (e, h, f), "normal", 2, expert_dim=0)]
        s = attrs["shared_expert_size"]
        if s:
            out += [Weight("shared_experts.linear_fc1.weight", (2 * s if gated else s, h), "normal", 0,
                           (s, s) if gated else ()),
                    Weight("shared_experts.linear_fc2.weight", (h, s), "normal", 1)]
            if attrs["shared_expert_gate"]:
                out.append(Weight("shared_experts.gate_weight", (1, h), "normal"))
        return out

    def active_parameters(self, attrs):
        # a token passes its top-k routed experts (and every shared one)
        e, k = attrs["num_experts"], attrs["topk"]
        return sum(numel(w.shape) if w.expert_dim is None else numel(w.shape) // e * k for w in self.weights(attrs))

    def partial_grad_weights(self, node, axis, placement):
        # the expert bias has no gradient to sum
        return [n for n in super().partial_grad_weights(node, axis, placement) if n != "router.expert_bias"]

    def hf_knobs(self):
        """The routing a Hugging Face MoE config asks for (Mixtral, Qwen-MoE, OLMoE, DeepSeek):
        a checkpoint whose router does something else is refused on import, not run with another
        routing (a norm_topk_prob: false checkpoint in a spec that renormalizes was off by 0.72).
        DeepSeek-V3's group-limited top-k scores each group by the sum of its best two experts
        (transformers' DeepseekV3TopkRouter), the op by its best topk / group_topk (Megatron): the
        two agree when topk / topk_group is 2, and a config where they do not is refused."""
        def first(*keys):
            def requested(config, n):
                for key in keys:
                    if config.get(key) is not None:
                        return [config[key]] * n
                return None
            return requested

        return (
            HFKnob("num_experts_per_tok", first("num_experts_per_tok"), lambda a: a["topk"]),
            HFKnob("num_local_experts / num_experts / n_routed_experts",
                   first("num_local_experts", "num_experts", "n_routed_experts"), lambda a: a["num_experts"]),
            HFKnob("norm_topk_prob", first("norm_topk_prob"), lambda a: a["topk_renorm"]),
            HFKnob("scoring_func", first("scoring_func"), lambda a: a["score_function"]),
            HFKnob("routed_scaling_factor", first("routed_scaling_factor"), lambda a: a["topk_scaling_factor"]),
            HFKnob("n_group", first("n_group"), lambda a: a["num_groups"]),
            HFKnob("topk_group", first("topk_group"), lambda a: a["group_topk"]),
            # Llama 4's experts take their token times its routing weight: the architecture's, never
            # in config.json (its mapping's import_defaults says so); other MoE configs weight the output
            HFKnob("moe_apply_probs_on_input", lambda config, n: [bool(config.get("moe_apply_probs_on_input"))] * n,
                   lambda a: a["apply_probs_on_input"]),
            HFKnob("n_group > 1: each group scored by its best 2 experts (num_experts_per_tok / topk_group)",
                   lambda config, n: [2] * n if isinstance(config.get("n_group"), int) and config["n_group"] > 1
                   else None,
                   lambda a: a["topk"] // a["group_topk"] if a["num_groups"] > 1 else None),
        )

    def rule_tp(self, attrs, ctx):
        if ctx.tp == 1:
            return LayoutRule(allowed=("I", "R", "S(s)"), accepts_reduction=True)
        return LayoutRule(fixed_inputs=("R",), fixed_outputs=("P",))

    def choices(self, attrs, settings, shapes=()):
        # the op's collectives and note depend on the expert-parallel size, not a layout axis
        return {"ep_size": settings.ep, "tp_size": settings.tp}

    def _uniform_rows(self, node, tokens: int) -> int:
        """(token, expert) rows one rank dispatches under uniform routing (capacity applied)."""
        a = node.attrs
        rows = tokens * a["topk"]
        if a["capacity_factor"]:
            per_expert = min(tokens, math.ceil(tokens * a["topk"] / a["num_experts"] * a["capacity_factor"]))
            rows = min(rows, per_expert * a["num_experts"])
        return rows

    def collectives(self, node, shapes_on, elt, mesh):
        a = node.attrs
        x = shapes_on("tp")[0]  # the tokens this rank routes (the TP group's, CP-local)
        tokens = numel(x[:-1])
        fwd, bwd = [], []
        if mesh.size("cp") > 1 and a["load_balancing_type"] == "aux_loss" and a["aux_loss_coeff"] > 0:
            fwd.append(("all_reduce", a["num_experts"] * 4))  # per-expert counts of the whole sequence (fp32)
        if a.get("ep_size", 1) > 1:
            moved = self._uniform_rows(node, tokens) * a["hidden_size"] * elt
            fwd += [("all_to_all", a["num_experts"] * 8), ("all_to_all", moved), ("all_to_all", moved)]
            bwd += [("all_to_all", moved), ("all_to_all", moved)]
        return fwd, bwd

    def comm_axis(self, node, collective):
        # tokens to and from their experts over EP; the aux loss's expert counts over CP
        return "ep" if collective == "all_to_all" else "cp"

    def flops(self, node, local_in, local_out, mesh):
        """The expert MLPs' GEMMs over the rows this rank computes under uniform routing (its own
        tokens' top-k rows: what it dispatches, on average, is what it receives), each expert's
        width over TP, and the shared experts' over every token: Megatron's count
        (num_floating_point_operations), which leaves out the router's small GEMM (num_experts
        outputs per token) as well. Backward: the input and the weight gradients, twice forward."""
        a = node.attrs
        x = local_in[0]
        tokens, h = numel(x[:-1]), x[-1]
        tp = a.get("tp_size", 1)
        gated = is_gated(a["activation"])
        f = a["ffn_hidden_size"] // tp
        forward = 2 * self._uniform_rows(node, tokens) * h * ((2 * f if gated else f) + f)
        s = a["shared_expert_size"] // tp
        forward += 2 * tokens * h * ((2 * s if gated else s) + s)
        return forward, 2 * forward

    def saved_bytes(self, node, local_in, local_out, elt):
        """The input, the router's fp32 logits and scores, and per dispatched row (uniform
        routing): the expert input, fc1's output and the activation's output."""
        a = node.attrs
        x = local_in[0]
        tokens, h = numel(x[:-1]), x[-1]
        tp = a.get("tp_size", 1)
        rows = self._uniform_rows(node, tokens)
        f = a["ffn_hidden_size"] // tp
        fc1 = 2 * f if is_gated(a["activation"]) else f
        out = [(node.inputs[0], numel(x) * elt), (node.id + ":router", 2 * tokens * a["num_experts"] * 4),
               (node.id + ":experts", rows * (h + fc1 + f) * elt)]
        s = a["shared_expert_size"] // tp
        if s:
            out.append((node.id + ":shared", tokens * ((2 * s if is_gated(a["activation"]) else s) + s) * elt))
        return out

    def note(self, node):
        a = node.attrs
        ep = a.get("ep_size", 1)
        local = a["num_experts"] // ep
        text = f"{node.attr_name}: {local} of {a['num_experts']} experts on this rank, top-{a['topk']}"
        if ep > 1:
            text += ("; dispatches tokens to the experts' ranks and back with all-to-alls over ep "
                     "(forward: counts, tokens, combine; backward: 2)")
        if not a["capacity_factor"]:
            text += "; dropless"
        return text

    def constructor(self, node, ctx):
        a = node.attrs
        kw = [f"topk={a['topk']}", "tp=self.tp", "ep=pg.ep", "cp=pg.cp"]
        defaults = {attr.name: attr.default for attr in self.attrs}
        for name in ("activation", "score_function", "topk_renorm", "load_balancing_type", "aux_loss_coeff",
                     "z_loss_coeff", "expert_bias", "expert_bias_update_rate", "shared_expert_size",
                     "shared_expert_gate", "init_std", "num_groups", "group_topk", "topk_scaling_factor",
                     "apply_probs_on_input"):
            if a[name] != defaults[name] or name == "init_std":
                kw.append(f"{name}={ctx.attr(node, name)}")
        if a["capacity_factor"]:
            kw.append(f"capacity_factor={a['capacity_factor']!r}")
        if not a["grouped_gemm"]:
            kw.append("grouped=False")
        return (f"runtime.MoELayer({a['hidden_size']}, {a['num_experts']}, {a['ffn_hidden_size']}, "
                f"{', '.join(kw)})")

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"

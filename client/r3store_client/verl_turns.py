"""verl's multi-turn agent loop with every turn's routes kept (verl 0.9; imports verl).

verl's `ToolAgentLoop` keeps the routes of the last generate call only, so the routes
earlier turns' tokens were generated with are replaced by the last call's prefill rows,
or by zeros where the engine's prefix cache held them. `ToolAgentLoop` here is verl's
own loop with its server manager wrapped (`TurnRecorder`): each call's routes are joined
to the earlier turns' (`turn_routes.Turns`), so the loop's one `routed_experts` holds
every turn's own rows, and the sample's extra fields name where each turn starts and
the weights it was generated with (`TURNS_FIELD`). Through r3store's TransferQueue
backend each turn is then stored as a segment of its own, with its policy version.

Chosen by configuration: name this class in the file `agent_loop_config_path` points to,
under verl's name for the loop, so that datasets that ask for `tool_agent` get it:

    - name: tool_agent
      _target_: r3store_client.verl_turns.ToolAgentLoop

(it is also registered as `tool_agent_r3`, for `default_agent_loop` or a dataset's
`agent_name`).
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as VerlToolAgentLoop

from r3store_client.turn_routes import TURNS_FIELD, Turns


class TurnRecorder:
    """A server manager whose `generate` answers each turn's routes joined to the
    earlier turns' of the same conversation; everything else is the wrapped one's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.turns = Turns()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        output = await self._inner.generate(*args, **kwargs)
        if output.routed_experts is not None:
            prompt_ids = kwargs["prompt_ids"] if "prompt_ids" in kwargs else args[1]
            extra = output.extra_fields or {}
            version = extra.get("min_global_steps", extra.get("global_steps"))
            output.routed_experts = self.turns.add(
                prompt_ids,
                output.token_ids,
                output.routed_experts,
                version if isinstance(version, int) and version >= 0 else None,
            )
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@register("tool_agent_r3")
class ToolAgentLoop(VerlToolAgentLoop):  # type: ignore[misc]
    """verl's `ToolAgentLoop`, its routes kept turn by turn (the module says how)."""

    def __init__(self, *args: Any, server_manager: Any, **kwargs: Any) -> None:
        self.recorder = TurnRecorder(server_manager)  # one loop per trajectory
        super().__init__(*args, server_manager=self.recorder, **kwargs)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        output: AgentLoopOutput = await super().run(sampling_params, **kwargs)
        meta = self.recorder.turns.meta()
        if meta is not None and output.routed_experts is not None:
            output.extra_fields[TURNS_FIELD] = meta.to_json()
        return output

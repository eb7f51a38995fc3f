"""MambaModelProvider under the OpenAI Agents SDK's Temporal plugin, on the real dev server: a
five-turn agent whose turns feed only their new messages, exactly as one stream fed the whole
rendered conversation; forks from older response ids; and who may continue whose conversation."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any

import pytest
from agents import ModelSettings, ModelTracing
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from mamba_stream.conversations import HANDLE_PREFIX, Conversations, open_handle, tool_schema
from mamba_stream.openai_agents import MambaModelProvider, conversation_start
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.scan import ChatTemplate
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import StreamOptions, id_key
from tests.openai_agents._agents import ASCII, Assistant, Forecast, HeldToGrammar, LongChat, sky
from tests.workflows import conftest as workflow_fixtures
from tests.workflows.conftest import FAST, doomed_worker, make_stack, replay_agents, sigkilled
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")
temporal_env = workflow_fixtures.temporal_env

QUESTIONS = ["hello", "what is a state?", "and a stream?", "why exact?", "thanks"]


async def _agent_worker(stack, exits, options: StreamOptions | None = None):
    """A worker of the agent workflows, with both plugins on its client."""
    queue = f"{stack.queue}-agents"
    provider = MambaModelProvider(task_queue=stack.queue, models="tiny-mamba2", options=options)
    plugins = [OpenAIAgentsPlugin(model_provider=provider,
                                  model_params=ModelActivityParameters(start_to_close_timeout=timedelta(seconds=60))),
               MambaStreamPlugin(keyring=stack.keyring)]
    with pytest.raises(ValueError, match="list the OpenAI Agents plugin first"):  # one line, not theirs
        await Client.connect(stack.address, plugins=plugins[::-1])
    client = await Client.connect(stack.address, plugins=plugins)
    await exits.enter_async_context(Worker(client, task_queue=queue, workflows=[Assistant, LongChat, HeldToGrammar]))
    return client, queue


async def _replays(client: Client, queue: str) -> int:
    """Every agent run recorded on `queue` replays (temporalio's Replayer) with the plugins its
    worker had; how many runs."""
    return await replay_agents(client, queue, [Assistant, LongChat, HeldToGrammar], list(client.config()["plugins"]))


def _expected_text(answers: list[str], replies: list[str]) -> str:
    """The whole conversation as one stream would be fed it: rendered at once, then the last reply."""
    tpl = ChatTemplate.plain()
    tools = [tool_schema("weather", "The weather in a city.", {
        "properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"], "title": "weather_args",
        "type": "object", "additionalProperties": False})]
    msgs: list[dict] = [{"role": "system", "content": "Answer in a few words."}]
    for q, a in zip(QUESTIONS, answers, strict=True):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return tpl.render(msgs[:-1], tools=tools, add_generation_prompt=True) + replies[-1]


async def test_an_agent_feeds_each_turn_once_and_ends_on_one_streams_checksum(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        client, queue = await _agent_worker(stack, stack.exits)
        start = conversation_start(stack.client, "alice")
        out = await stack.client.execute_workflow(Assistant.run, args=[QUESTIONS, None], task_queue=queue, **start)
        assert await _replays(client, queue) == 1
        answers, ids = out[0::2], out[1::2]
        # the framework's payloads (the conversation) are sealed in history like the streams' own
        raw = await Client.connect(stack.address)
        for wid in (start["id"],):
            events = (await raw.get_workflow_handle(wid).fetch_history()).events
            blob = b"".join(e.SerializeToString() for e in events)
            assert b"invoke_model_activity" in blob  # it is the agent's history
            for text in [*QUESTIONS, "Answer in a few words.", "weather", *(a for a in answers if len(a) >= 4)]:
                assert text.encode() not in blob, text
        assert all(i.startswith(HANDLE_PREFIX + ".") for i in ids) and len(set(ids)) == 5
        tag = start["id"].split(".")[1]
        # the conversation's tasks carry its principal's fairness key (issue 50): the agent's
        # workflow, started with `conversation_start`, and so the model turns it schedules
        desc = await stack.client.get_workflow_handle(start["id"]).describe()
        assert desc.raw_description.workflow_execution_info.priority.fairness_key == tag
        key = id_key(stack.client, start["id"])
        handles = [open_handle(key, tag, i) for i in ids]
        assert len({h.stream_id for h in handles}) == 1 and not any(h.forked for h in handles)
        assert [h.seq for h in handles] == [2, 4, 6, 8, 10]
        sid = handles[0].stream_id
        desc = await stack.client.get_workflow_handle(sid).describe()  # the turns' stream: the same key
        assert desc.raw_description.workflow_execution_info.priority.fairness_key == tag
        # the state: exactly one stream fed the whole rendered conversation
        text = _expected_text(answers, [h.reply for h in handles])
        model = local("tiny-mamba2")
        tokens = model.transform.encode(text)
        truth = model.advance(model.initial_state(), tokens)
        receipt = await stack.streams.receipt(sid)
        assert receipt.position == len(tokens)
        assert receipt.checksum == plaintext_checksum(truth.state.tensors)

        # the model activity of turn 1 retried (its workflow, run and activity id), after the
        # conversation went on: the same response id, and nothing advanced twice
        run_id = (await stack.client.get_workflow_handle(start["id"]).describe()).run_id
        conv = Conversations(stack.client, task_queue=stack.queue, models="tiny-mamba2")
        tools = [tool_schema("weather", "The weather in a city.", {
            "properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
            "title": "weather_args", "type": "object", "additionalProperties": False})]
        retried = await conv.turn(caller=(start["id"], run_id, "1"), model_id="tiny-mamba2",
                                  system="Answer in a few words.", tools=tools, items=QUESTIONS[0], previous=None,
                                  max_tokens=6, settings={"temperature": 0.8, "top_k": 20, "logit_bias": ASCII})
        assert retried.response_id == ids[0]
        assert await stack.streams.receipt(sid) == receipt


def _cause_types(err: BaseException) -> list[str]:
    out, e = [], err
    while e is not None:
        out.append(getattr(e, "type", None) or type(e).__name__)
        e = e.__cause__ or getattr(e, "cause", None)
    return out


async def test_an_older_response_forks_another_principals_is_refused_and_nothing_moves(temporal_env, tmp_path):
    """Turn 3's response id continued in another workflow of alice's forks her conversation
    there (a new stream; the old one unchanged), exactly as one stream fed that history; bob's
    workflow given it is refused `PrincipalMismatch`; an agent started without alice's sealed
    memo (none, or one in clear from a keyless client) is refused `SealerMismatch`."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        _, queue = await _agent_worker(stack, stack.exits)
        start = conversation_start(stack.client, "alice")
        out = await stack.client.execute_workflow(Assistant.run, args=[QUESTIONS, None], task_queue=queue, **start)
        answers, ids = out[0::2], out[1::2]
        tag, key = start["id"].split(".")[1], id_key(stack.client, start["id"])
        sid = open_handle(key, tag, ids[0]).stream_id
        before = await stack.streams.receipt(sid)

        again = conversation_start(stack.client, "alice")
        forked = await stack.client.execute_workflow(Assistant.run, args=[["a new turn"], ids[2]], task_queue=queue,
                                                     **again)
        h = open_handle(key, tag, forked[1])
        assert h.forked and h.stream_id != sid and h.seq == 2  # a fresh stream from turn 3's state
        assert await stack.streams.receipt(sid) == before  # the conversation it came from did not move
        tpl = ChatTemplate.plain()
        msgs: list[dict] = [{"role": "system", "content": "Answer in a few words."}]
        for q, a in zip(QUESTIONS[:3], answers[:3], strict=True):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": "a new turn"})
        tools = [tool_schema("weather", "The weather in a city.", {
            "properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
            "title": "weather_args", "type": "object", "additionalProperties": False})]
        model = local("tiny-mamba2")
        tokens = model.transform.encode(tpl.render(msgs, tools=tools, add_generation_prompt=True) + h.reply)
        receipt = await stack.streams.receipt(h.stream_id)
        assert receipt.position == len(tokens)
        assert receipt.checksum == plaintext_checksum(model.advance(model.initial_state(), tokens).state.tensors)

        bob = conversation_start(stack.client, "bob")
        with pytest.raises(WorkflowFailureError) as refused:
            await stack.client.execute_workflow(Assistant.run, args=[["hi"], ids[-1]], task_queue=queue, **bob)
        assert "PrincipalMismatch" in _cause_types(refused.value)
        assert await stack.streams.receipt(sid) == before

        bare = {"id": stack.streams.new_id("alice")}  # alice's id, no memo
        with pytest.raises(WorkflowFailureError) as refused:
            await stack.client.execute_workflow(Assistant.run, args=[["hi"], None], task_queue=queue, **bare)
        assert "SealerMismatch" in _cause_types(refused.value)
        keyless = await Client.connect(stack.address)  # no keyring: memo and input in clear
        started = await keyless.start_workflow("Assistant", args=[["hi"], None], task_queue=queue,
                                               id=stack.streams.new_id("alice"),
                                               memo={"mamba_stream.principal": "alice"})
        with pytest.raises(WorkflowFailureError) as refused:  # read by alice: the failure is sealed
            await stack.client.get_workflow_handle(started.id).result()
        assert "SealerMismatch" in _cause_types(refused.value)
        assert await stack.streams.receipt(sid) == before


async def test_a_handle_does_not_open_altered_or_under_another_key():
    from mamba_stream.conversations import ResponseHandle, seal_handle
    from mamba_stream.failures import InvalidRequest
    from mamba_stream.state_codec import PrincipalMismatch

    h = ResponseHandle(stream_id="ms.x", model_id="m", epoch=0, seq=2, fed_seq=1, reply="hi\n")
    key, tag = b"k" * 32, "0" * 32
    text = seal_handle(key, tag, h)
    assert open_handle(key, tag, text) == h and "hi" not in text
    assert seal_handle(key, tag, h) == text  # a retried turn seals the same id
    assert seal_handle(key, tag, h.model_copy(update={"seq": 4})).split(".")[2][:16] != text.split(".")[2][:16]
    body = text.split(".")[2]
    altered = f"{HANDLE_PREFIX}.{tag}.{body[:-2]}{'A' if body[-2] != 'A' else 'B'}{body[-1]}"
    for bad, why in ((altered, InvalidRequest), (text, InvalidRequest), ("resp_123", InvalidRequest),
                     (text.replace(tag, "1" * 32), PrincipalMismatch)):
        with pytest.raises(why) as err:
            open_handle(b"j" * 32 if bad is text else key, tag, bad)
        assert err.value.details().get("field", getattr(err.value, "field", None)) == "previous_response_id"


def _model_inputs(events) -> list[int]:
    """The sizes of the model activities' inputs, in order, as history holds them."""
    from temporalio.api.enums.v1 import EventType

    return [e.activity_task_scheduled_event_attributes.input.ByteSize() for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == "invoke_model_activity"]


async def test_a_long_conversation_adds_to_history_what_each_turn_added(temporal_env, tmp_path):
    """200 turns, continued as new every 100 with the last response id alone (the principal's memo
    carried over): every model call's input in history is the same size give or take a few digits
    (the new message and a handle), not the conversation; one stream holds all 200 turns."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        client, queue = await _agent_worker(stack, stack.exits)
        start = conversation_start(stack.client, "alice")
        last = await stack.client.execute_workflow(LongChat.run, args=[200, 100, None, 0], task_queue=queue, **start)
        assert await _replays(client, queue) == 2  # both runs, continued as new
        sizes = []
        async for wf in stack.client.list_workflows(f"WorkflowId = '{start['id']}'"):
            events = (await stack.client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()).events
            sizes.append(_model_inputs(events))
        assert sorted(len(s) for s in sizes) == [100, 100]  # two runs, 100 calls each
        flat = [n for run in sizes for n in run[1:]]  # every call after a run's first carries a handle
        # the turn's number (1-3 digits), the handle's chunk numbers and reply (base64 of 2-3 bytes
        # more): 32 bytes of spread in 200 turns, where a turn adds ~60 bytes to the conversation
        assert max(flat) - min(flat) <= 32, (min(flat), max(flat))
        tag, key = start["id"].split(".")[1], id_key(stack.client, start["id"])
        h = open_handle(key, tag, last)
        assert h.seq == 400 and not h.forked  # one stream, two chunks a turn, 200 turns


async def test_a_stream_worker_sigkilled_mid_turn_changes_no_bit_of_the_conversation(temporal_env, tmp_path):
    """The worker holding the conversation's stream dies (SIGKILL) with turn 3's feed (chunk 5)
    committed and not yet recorded; a rescuer takes the stream over, the model activity's chunk
    calls are answered from the stream's records, and the conversation ends on the replies and
    the checksum of an uninterrupted run of the same agent (a fixed seed)."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits, doomed_worker(stack, tmp_path, "recorded", "5", "local") as proc:
        opts = StreamOptions(**{**FAST.model_dump(include=set(FAST.model_fields_set)), "checkpoints_kept": 16})
        client, queue = await _agent_worker(stack, stack.exits, options=opts)
        start = conversation_start(stack.client, "alice")
        run = await stack.client.start_workflow(Assistant.run, args=[QUESTIONS, None, 11], task_queue=queue,
                                                **start)
        await sigkilled(proc)
        await stack.worker()  # the rescuer: workflows and activities, as every worker is
        out = await run.result()
        clean = await stack.client.execute_workflow(Assistant.run, args=[QUESTIONS, None, 11], task_queue=queue,
                                                    **conversation_start(stack.client, "alice"))
        assert out[0::2] == clean[0::2]  # the same replies
        tag, key = start["id"].split(".")[1], id_key(stack.client, start["id"])
        crashed, uninterrupted = open_handle(key, tag, out[-1]), open_handle(key, tag, clean[-1])
        assert crashed.seq == uninterrupted.seq == 10 and not crashed.forked
        assert await _replays(client, queue) == 2  # the crashed run and the clean one
        a = await stack.streams.receipt(crashed.stream_id)
        b = await stack.streams.receipt(uninterrupted.stream_id)
        assert (a.position, a.checksum) == (b.position, b.checksum)


async def test_a_required_tool_call_and_a_structured_output_are_held_to_their_grammars(temporal_env, tmp_path):
    """tool_choice "required" makes the reply a call of the agent's tool, its arguments its
    parameters' JSON; an output type makes the reply that type's JSON (issue 48, item 5)."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        _, queue = await _agent_worker(stack, stack.exits)
        calls, outputs, plan = await stack.client.execute_workflow(
            HeldToGrammar.run, task_queue=queue, **conversation_start(stack.client, "alice"))
    [(name, args)] = calls
    city = json.loads(args)["place"]["city"]
    assert name == "sky" and isinstance(city, str) and len(city) <= 8 and set(json.loads(args)) == {"place"}
    assert outputs == [f"clear over {city}"]
    assert Forecast.model_validate(plan).model_dump() == plan


async def test_a_streamed_response_shows_the_text_as_it_is_sampled_and_ends_on_get_responses_reply(
        temporal_env, tmp_path):
    """`stream_response` in a model activity: created, the message's text deltas (never a tool
    call's text), the items done, completed; its deltas spell the reply `get_response` gives for
    the same turn (a fixed seed, another activity), and a forced call shows no text at all."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        client, queue = await _agent_worker(stack, stack.exits)
        start = conversation_start(stack.client, "alice")
        agent = await stack.client.start_workflow(Assistant.run, args=[[], None], task_queue=queue, **start)
        await agent.result()
        run_id = (await agent.describe()).run_id
        provider = MambaModelProvider(task_queue=stack.queue, models="tiny-mamba2")
        model = provider.get_model("tiny-mamba2")
        tools = [sky]

        async def both(settings: ModelSettings, activity: str) -> tuple[list, Any]:
            env = ActivityEnvironment(client=client)
            kw = dict(system_instructions="Answer.", input="hello there", model_settings=settings, tools=tools,
                      output_schema=None, handoffs=[], tracing=ModelTracing.DISABLED, previous_response_id=None,
                      conversation_id=None, prompt=None)
            async def streamed() -> list:
                return [e async for e in model.stream_response(**kw)]

            async def whole() -> Any:
                return await model.get_response(**kw)
            env.info = dataclasses.replace(env.info, workflow_id=start["id"], workflow_run_id=run_id,
                                           activity_id=f"{activity}-s")
            events = await env.run(streamed)
            env.info = dataclasses.replace(env.info, workflow_id=start["id"], workflow_run_id=run_id,
                                           activity_id=f"{activity}-g")
            return events, await env.run(whole)

        extra = {"seed": 5, "top_k": 20, "logit_bias": ASCII}
        events, plain = await both(ModelSettings(max_tokens=40, extra_args=extra), "free")
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        [message] = [i for i in plain.output if i.type == "message"]
        assert text == message.content[0].text and "<tool_call>" not in text
        assert events[-1].response.output[0].content[0].text == text
        assert events[-1].response.id.startswith(HANDLE_PREFIX + ".")

        events, plain = await both(ModelSettings(max_tokens=96, tool_choice="required", extra_args=extra), "call")
        assert not any(e.type == "response.output_text.delta" and e.delta for e in events)
        calls = [i for i in events[-1].response.output if i.type == "function_call"]
        assert [c.name for c in calls] == ["sky"] and [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in plain.output if c.type == "function_call"]


async def test_a_replys_text_is_shown_up_to_a_call_or_its_end_and_a_possible_start_of_one_is_held():
    from mamba_stream.openai_agents._provider import _Shown

    live = _Shown("\n")
    assert [live.feed(p) for p in ("Hel", "lo <to", "ol_call>{\"name\": 1}", " more")] == ["Hel", "lo ", "", ""]
    assert live.shown == "Hello "
    live = _Shown("<|end|>")
    assert [live.feed(p) for p in ("a<", "b", "<|e", "nd|>x")] == ["a", "<b", "", ""]
    assert live.shown == "a<b"
    live = _Shown("\n")
    assert [live.feed(p) for p in ("one", " two\nthree")] == ["one", " two"] and live.shown == "one two"

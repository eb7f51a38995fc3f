"""MambaModel under Pydantic AI's Temporal durability, on the real dev server: a multi-turn agent
with a function tool whose requests feed only their new messages and end on the state of one
stream fed the whole rendered conversation; a retried model activity answering the same; an
edited history forking (or starting anew) with the original stream unchanged; another
principal's response refused; a structured output held to its schema. Without a server: which
response a request goes on from, and the conversion of Pydantic AI's messages, settings, tool
choice and output mode."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
from pydantic_ai.durable_exec.temporal._durability import _RequestParams
from pydantic_ai.exceptions import PydanticAIDeprecationWarning
from pydantic_ai.messages import (
    ImageUrl,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    RetryFeedbackPart,
    RetryInfo,
    RetryPromptPart,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.native_tools import WebSearchTool
from pydantic_ai.output import OutputObjectDefinition
from pydantic_ai.settings import ToolOrOutput
from pydantic_ai.tools import ToolDefinition
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from mamba_stream.conversations import ParsedReply, ResponseHandle, Turn, chat_messages, open_handle, tool_schema
from mamba_stream.failures import InvalidRequest
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.pydantic_ai import PROVIDER_NAME, MambaModel, conversation_start, message_items, sampling
from mamba_stream.pydantic_ai._messages import chat_form, response_message, system_part
from mamba_stream.pydantic_ai._model import _reply
from mamba_stream.scan import ChatTemplate
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import id_key
from tests.openai_agents.test_provider import _cause_types
from tests.pydantic_ai._agents import CALL, CALL_ARGS, CALL_TEXT, INSTRUCTIONS, MODEL, Forecast, Plans, WeatherChat
from tests.workflows import conftest as workflow_fixtures
from tests.workflows.conftest import Stack, doomed_worker, eventually, make_stack, replay_agents, sigkilled
from tests.workflows.test_stream_workflow import local

temporal_env = workflow_fixtures.temporal_env

QUESTIONS = ["hello", "and in Rome?", "and Nice?", "tomorrow?", "thanks"]
MODEL_REQUEST = "agent__weather_chat__model_request"


async def _agent_worker(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> tuple[Client, str]:
    """A worker of the agent workflow, with Pydantic AI's plugin then ours on its client; the
    model's streams are the stack's (its task queue, as a worker's environment names it)."""
    monkeypatch.setenv("MAMBA_STREAM_TASK_QUEUE", stack.queue)
    queue = f"{stack.queue}-agents"
    client = await Client.connect(stack.address, plugins=[PydanticAIPlugin(), MambaStreamPlugin(keyring=stack.keyring)])
    await stack.exits.enter_async_context(Worker(client, task_queue=queue, workflows=[WeatherChat, Plans]))
    return client, queue


async def _replays(client: Client, queue: str) -> int:
    """Every agent run recorded on `queue` replays (temporalio's Replayer) with the plugins its
    worker had; how many runs."""
    return await replay_agents(client, queue, [WeatherChat, Plans], list(client.config()["plugins"]))


async def _converse(stack: Stack, queue: str, questions: list[str], history: list[ModelMessage] | None = None,
                    principal: str = "alice", seed: int | None = None) -> tuple[list[ModelMessage], dict[str, Any]]:
    start = conversation_start(stack.client, principal)
    past = ModelMessagesTypeAdapter.dump_json(history).decode() if history else None
    out = await stack.client.execute_workflow(WeatherChat.run, args=[questions, past, seed], task_queue=queue, **start)
    return ModelMessagesTypeAdapter.validate_json(out), start


def _handles(stack: Stack, wid: str, messages: list[ModelMessage]) -> list[ResponseHandle]:
    tag, key = wid.split(".")[1], id_key(stack.client, wid)
    responses = [m for m in messages if isinstance(m, ModelResponse)]
    assert all(r.provider_name == PROVIDER_NAME and r.model_name == "tiny-mamba2" for r in responses)
    return [open_handle(key, tag, r.provider_response_id or "") for r in responses]


async def _first_request(stack: Stack, wid: str) -> tuple[_RequestParams, str, str]:
    """The first model activity of the agent workflow `wid`: its input as history holds it, and
    its run and activity ids."""
    handle = stack.client.get_workflow_handle(wid)
    for e in (await handle.fetch_history()).events:
        attrs = e.activity_task_scheduled_event_attributes
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and attrs.activity_type.name == MODEL_REQUEST:
            params = (await stack.client.data_converter.decode(attrs.input.payloads, [_RequestParams, Any]))[0]
            return params, (await handle.describe()).run_id, attrs.activity_id
    raise AssertionError("no model request in the agent's history")


def _chat(messages: list[ModelMessage]) -> list[dict[str, Any]]:
    """The conversation as chat-template messages, written out by hand from Pydantic AI's. A
    response is one assistant message (its text, then its calls), as the model sampled it and as
    it is fed again as input items (`chat_messages`)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    for m in messages:
        if isinstance(m, ModelResponse):
            text = "".join(p.content for p in m.parts if isinstance(p, TextPart))
            calls = [{"id": p.tool_call_id, "type": "function", "function": {"name": p.tool_name, "arguments": p.args}}
                     for p in m.parts if isinstance(p, ToolCallPart)]
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        for p in m.parts:
            if isinstance(p, UserPromptPart):
                out.append({"role": "user", "content": p.content})
            elif isinstance(p, ToolReturnPart):
                out.append({"role": "tool", "tool_call_id": p.tool_call_id, "content": p.content})
            else:
                raise AssertionError(p)
    return out


def _expected(messages: list[ModelMessage], tools: list[dict[str, Any]]) -> list[str]:
    """Each request's whole conversation as the plain template renders it (`_chat`)."""
    tpl = ChatTemplate.plain()
    return [tpl.render(_chat(messages[:i]), tools=tools, add_generation_prompt=True)
            for i, m in enumerate(messages) if isinstance(m, ModelResponse)]


async def test_an_agent_with_a_tool_feeds_each_request_once_and_ends_on_one_streams_checksum(
        temporal_env, tmp_path, monkeypatch):
    """Five questions, each answered by a tool call, the tool's return, then text: ten model
    requests on one stream, each after the first fed exactly the rendering of the messages after
    the response before it; the stream ends on the checksum of one stream fed the whole rendered
    conversation; the first model activity retried answers the same response and moves nothing."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        client, queue = await _agent_worker(stack, monkeypatch)
        messages, start = await _converse(stack, queue, QUESTIONS)
        assert await _replays(client, queue) == 1
        wid = start["id"]
        responses = [m for m in messages if isinstance(m, ModelResponse)]
        kinds = [[type(p).__name__ for p in r.parts] for r in responses]
        assert kinds == [["TextPart", "ToolCallPart"], ["TextPart"]] * len(QUESTIONS)
        assert all(r.parts[0].content == CALL_TEXT for r in responses[0::2])
        calls = [r.parts[1] for r in responses[0::2]]
        assert all(isinstance(c, ToolCallPart) and c.args == CALL_ARGS for c in calls)
        returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        assert [(r.tool_call_id, r.content) for r in returns] == [(c.tool_call_id, "sunny in Paris") for c in calls]
        handles = _handles(stack, wid, messages)
        assert len({h.stream_id for h in handles}) == 1 and not any(h.forked for h in handles)
        # the framework's payloads (the whole conversation, every request) are sealed in history
        raw = await Client.connect(stack.address)
        blob = b"".join(e.SerializeToString() for e in (await raw.get_workflow_handle(wid).fetch_history()).events)
        assert MODEL_REQUEST.encode() in blob  # it is the agent's history
        for text in (*QUESTIONS, INSTRUCTIONS, "sunny in Paris", CALL_TEXT.strip()):
            assert text.encode() not in blob, text
        assert [h.seq for h in handles] == list(range(2, 2 * len(responses) + 1, 2))
        assert handles[0].reply == CALL

        params, run_id, activity_id = await _first_request(stack, wid)
        tools = [tool_schema(t.name, t.description, t.parameters_json_schema)
                 for t in params.model_request_parameters.function_tools]
        assert [t["function"]["name"] for t in tools] == ["weather"]
        model = local("tiny-mamba2")
        encode = model.transform.encode
        rendered = _expected(messages, tools)
        head = ChatTemplate.plain().render([{"role": "system", "content": INSTRUCTIONS}], tools=tools,
                                          add_generation_prompt=False)
        assert responses[0].usage.input_tokens == len(encode(rendered[0])) - len(encode(head))  # from the prefix
        for k in range(1, len(responses)):
            held = rendered[k - 1] + handles[k - 1].reply  # what the stream holds before request k
            assert rendered[k].startswith(held)
            fed = responses[k].usage.input_tokens
            assert fed == len(encode(rendered[k][len(held):])) and fed < 60, (k, fed)
        # the state: exactly one stream fed the whole rendered conversation
        tokens = encode(rendered[-1] + handles[-1].reply)
        receipt = await stack.streams.receipt(handles[0].stream_id)
        assert receipt.position == len(tokens)
        assert receipt.checksum == plaintext_checksum(model.advance(model.initial_state(), tokens).state.tensors)

        # the first model activity again (its workflow, run and activity id), as Temporal retries
        # it, after the conversation went on: the same response, and the stream did not move
        env = ActivityEnvironment(client=client)
        env.info = dataclasses.replace(env.info, workflow_id=wid, workflow_run_id=run_id, activity_id=activity_id)
        again = await env.run(MODEL.request, params.messages, params.model_settings, params.model_request_parameters)
        assert again.provider_response_id == responses[0].provider_response_id
        assert again.parts == responses[0].parts
        assert await stack.streams.receipt(handles[0].stream_id) == receipt
        # and streamed (Pydantic AI's `request_stream`): the turn's parts as events, then the same response
        async def streamed() -> tuple[list[Any], ModelResponse]:
            async with MODEL.request_stream(params.messages, params.model_settings,
                                            params.model_request_parameters) as stream:
                return [e async for e in stream], stream.get()
        events, response = await env.run(streamed)
        assert [e.part for e in events if type(e).__name__ == "PartStartEvent"] == responses[0].parts
        assert response.provider_response_id == responses[0].provider_response_id


def _edit(message: ModelMessage, text: str) -> ModelRequest:
    assert isinstance(message, ModelRequest) and isinstance(message.parts[0], UserPromptPart)
    return dataclasses.replace(message, parts=[dataclasses.replace(message.parts[0], content=text)])


async def test_an_edited_history_forks_where_it_still_matches_and_the_stream_it_left_does_not_move(
        temporal_env, tmp_path, monkeypatch):
    """Two questions asked; then the second is altered in the history another run goes on from:
    the first question's responses still digest as their stream was fed, so that run forks the
    stream after them (a new stream, fed exactly the edited messages and the new question), and
    the original stream is unchanged. With the first exchange dropped no response matches: a new
    conversation, fed the whole history. Each ends as one stream fed its whole conversation."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        _, queue = await _agent_worker(stack, monkeypatch)
        messages, start = await _converse(stack, queue, QUESTIONS[:2])
        first = _handles(stack, start["id"], messages)
        sid = first[0].stream_id
        before = await stack.streams.receipt(sid)
        params, _, _ = await _first_request(stack, start["id"])
        tools = [tool_schema(t.name, t.description, t.parameters_json_schema)
                 for t in params.model_request_parameters.function_tools]
        model = local("tiny-mamba2")
        encode = model.transform.encode

        edited = [*messages[:4], _edit(messages[4], "and in Oslo?"), *messages[5:]]
        dropped = messages[4:]
        # (the history, whether the stream it goes on from is a fork)
        for history, forks in ((edited, True), (dropped, False)):
            out, again = await _converse(stack, queue, ["and tomorrow?"], history=history)
            assert out[:len(history)] == history
            new = [m for m in out[len(history):] if isinstance(m, ModelResponse)]
            handles = _handles(stack, again["id"], new)
            assert handles[0].stream_id != sid and handles[0].seq == 2 and handles[0].forked == forks
            # the next request goes on from the new response: its stream, not forked
            assert handles[1].stream_id == handles[0].stream_id and handles[1].seq == 4 and not handles[1].forked
            # the history after the point it goes on from is fed as items: the responses there too
            rendered = _expected(out, tools)
            k = sum(isinstance(m, ModelResponse) for m in history)  # the first new response's request
            if forks:  # after response 2, as its stream held it: the edited question on
                held = rendered[1] + first[1].reply
            else:  # the whole history, after the system part's prefix state
                held = ChatTemplate.plain().render([{"role": "system", "content": INSTRUCTIONS}], tools=tools,
                                                   add_generation_prompt=False)
            assert rendered[k].startswith(held)
            assert new[0].usage.input_tokens == len(encode(rendered[k][len(held):]))
            tokens = encode(rendered[-1] + handles[-1].reply)
            receipt = await stack.streams.receipt(handles[0].stream_id)
            assert receipt.position == len(tokens)
            assert receipt.checksum == plaintext_checksum(model.advance(model.initial_state(), tokens).state.tensors)
            assert await stack.streams.receipt(sid) == before  # the conversation it came from did not move


async def test_another_principals_response_in_the_history_is_refused_and_nothing_moves(
        temporal_env, tmp_path, monkeypatch):
    """Bob's agent given alice's conversation (her responses' sealed handles in its messages) is
    refused, typed `PrincipalMismatch`, before anything is fed: alice's stream does not move and
    bob has no stream."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        _, queue = await _agent_worker(stack, monkeypatch)
        messages, start = await _converse(stack, queue, QUESTIONS[:1])
        sid = _handles(stack, start["id"], messages)[0].stream_id
        before = await stack.streams.receipt(sid)
        with pytest.raises(WorkflowFailureError) as refused:
            await _converse(stack, queue, ["hi"], history=messages, principal="bob")
        assert "PrincipalMismatch" in _cause_types(refused.value)
        assert await stack.streams.receipt(sid) == before

        async def listed() -> list[str]:  # the server's list is eventually consistent: alice's shows first
            return [wf.id async for wf in stack.client.list_workflows(f"TaskQueue = '{stack.queue}'")]
        assert await eventually(listed) == [sid]  # bob has no stream


async def test_a_structured_output_is_held_to_its_schema_as_a_tool_call_or_as_the_text(
        temporal_env, tmp_path, monkeypatch):
    """A random-weight model's reply is a valid `Forecast` at the first request: through the output
    tool (Pydantic AI's tool output: the reply must be a call, its arguments held to the schema)
    and as the reply's text (native output)."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        client, queue = await _agent_worker(stack, monkeypatch)
        (by_tool, tool_kinds), (as_text, text_kinds) = await stack.client.execute_workflow(
            Plans.run, task_queue=queue, **conversation_start(stack.client, "alice"))
        assert await _replays(client, queue) == 1
    assert Forecast.model_validate(by_tool).model_dump() == by_tool and tool_kinds == [["tool-call"]]
    assert Forecast.model_validate(as_text).model_dump() == as_text and text_kinds == [["text"]]


class _Conversations:
    """The part of `Conversations` a `MambaModel` uses, over handles kept in memory: which
    response a request goes on from, and what it feeds, without a stream."""

    def __init__(self, handles: dict[str, ResponseHandle], past: bool = False) -> None:
        self.handles, self.past, self.turns = handles, past, []

    def open(self, workflow_id: str, response_id: str) -> ResponseHandle:
        return self.handles[response_id]

    def digest(self, workflow_id: str | None, system: str | None, messages: list[dict[str, Any]]) -> str:
        return json.dumps([system, messages], sort_keys=True)

    async def turn(self, **kw: Any) -> Turn:
        self.turns.append(kw)
        if kw["previous"] is not None and self.past:  # its state has left the stream's window
            raise WorkflowUpdateFailedError(ApplicationError("gone", type="RewindPastWindow"))
        reply = ParsedReply(text="ok", tool_calls=(), body="ok")
        told = [*kw["history"], *chat_messages(kw["items"]), reply.message(())]
        handle = ResponseHandle(stream_id="s", model_id="tiny-mamba2", epoch=0, seq=2, fed_seq=1, reply="ok\n",
                                digest=self.digest(None, kw["system"], told))
        return Turn(response_id=f"new{len(self.turns)}", handle=handle, reply=reply, call_ids=(), fed_tokens=1,
                    result=None)  # type: ignore[arg-type]


async def test_a_request_goes_on_from_the_latest_response_its_history_still_matches(monkeypatch):
    """Unchanged: after the latest response, feeding what follows. The second question edited:
    after the first response (a fork). The first edited: a new conversation, fed everything; and
    so is one whose matching response has left its stream's window."""
    def said(text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    def answered(text: str) -> dict[str, Any]:
        return {"role": "assistant", "content": text}

    system = "Be brief."
    d1 = json.dumps([system, [said("u1"), answered("a")]], sort_keys=True)
    d2 = json.dumps([system, [said("u1"), answered("a"), said("u2"), answered("b")]], sort_keys=True)
    handles = {f"r{i}": ResponseHandle(stream_id="s", model_id="tiny-mamba2", epoch=0, seq=2 * i, fed_seq=2 * i - 1,
                                       reply=t + "\n", digest=d) for i, t, d in ((1, "a", d1), (2, "b", d2))}

    def request(text: str) -> ModelRequest:
        return ModelRequest(parts=[UserPromptPart(text)], instructions=system)

    def response(text: str, rid: str) -> ModelResponse:
        return ModelResponse(parts=[TextPart(text)], provider_name=PROVIDER_NAME, provider_response_id=rid)

    history = [request("u1"), response("a", "r1"), request("u2"), response("b", "r2"), request("u3")]
    env = ActivityEnvironment()
    user = {"type": "message", "role": "user"}
    for messages, past, previous, fed in (
            (history, False, ["r2"], [[{**user, "content": "u3"}]]),
            ([*history[:2], request("u2!"), *history[3:]], False, ["r1"],
             [[{**user, "content": "u2!"}, {"type": "message", "role": "assistant", "content": "b"},
               {**user, "content": "u3"}]]),
            ([request("u1!"), *history[1:]], False, [None], [[{**user, "content": c} if c[0] == "u" else
                                                              {"type": "message", "role": "assistant", "content": c}
                                                              for c in ("u1!", "a", "u2", "b", "u3")]]),
            ([*history[:2], request("u2!"), *history[3:]], True, ["r1", None], None)):
        fake = _Conversations(handles, past=past)
        model = MambaModel("tiny-mamba2")
        monkeypatch.setattr(model, "conversations", lambda fake=fake: fake)
        turn = await env.run(model._turn, messages, None, ModelRequestParameters())
        assert [t["previous"] for t in fake.turns] == previous
        if fed is not None:
            assert [t["items"] for t in fake.turns] == fed
        assert fake.turns[-1]["system"] == system
        # the response's digest is the whole conversation's: the next request goes on from it
        assert turn.handle.digest == fake.digest(None, system, [
            *chat_form([message_items(m) for m in messages], {}, len(messages) - 1), answered("ok")])


def test_messages_become_the_items_and_chat_messages_a_stream_is_fed():
    request = ModelRequest(parts=[SystemPromptPart("Be brief."), UserPromptPart(["hi", "there"])])
    ours = ModelResponse(parts=[TextPart("Let me look."), ToolCallPart("weather", '{"city":  "Paris"}', "call_1")],
                         provider_name=PROVIDER_NAME)
    with pytest.warns(PydanticAIDeprecationWarning):  # older histories hold them
        legacy = [RetryPromptPart("city must be a string", tool_name="weather", tool_call_id="call_2"),
                  RetryPromptPart("answer in French")]
    returns = ModelRequest(parts=[ToolReturnPart("weather", {"sky": "clear"}, "call_1"), *legacy,
                                  ToolReturnPart("weather", "no such city", "call_4", outcome="retried"),
                                  RetryFeedbackPart("say it in French", retry=RetryInfo(cause="model_retry"))])
    theirs = ModelResponse(parts=[TextPart("Il fait beau."), ToolCallPart("weather", {"city": "Nice"}, "c3")])
    messages: list[ModelMessage] = [request, ours, returns, theirs]
    system, lead = system_part(messages, ["Answer in a few words."])
    assert (system, lead) == ("Be brief.\n\nAnswer in a few words.", 1)
    items = [message_items(m, skip=lead if i == 0 else 0) for i, m in enumerate(messages)]
    assert items == [
        [{"type": "message", "role": "user",
          "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "there"}]}],
        [{"type": "message", "role": "assistant", "content": "Let me look."},
         {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":  "Paris"}'}],
        [{"type": "function_call_output", "call_id": "call_1", "output": '{"sky":"clear"}'},
         {"type": "function_call_output", "call_id": "call_2",
          "output": "city must be a string\n\nFix the errors and try again."},
         {"type": "message", "role": "user", "content": "Validation feedback:\nanswer in French\n\nFix the errors and "
                                                        "try again."},
         {"type": "function_call_output", "call_id": "call_4", "output": returns.parts[-2].model_response_str()},
         {"type": "message", "role": "user", "content": returns.parts[-1].model_response()}],
        [{"type": "message", "role": "assistant", "content": "Il fait beau."},
         {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": '{"city":"Nice"}'}],
    ]
    # a response of this model is the one message its turn recorded: text and calls together,
    # the arguments as sampled; the others read as a turn's items are
    text, calls, ids = response_message(ours)
    assert (text, calls, ids) == ("Let me look.", (("weather", '{"city":  "Paris"}'),), ("call_1",))
    mine = {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":  "Paris"}'}}]}
    chat = chat_form(items, {1: mine}, 3)
    assert chat[:2] == [{"role": "user", "content": "hithere"}, mine]
    assert chat[2:] == chat_messages([*items[2], *items[3]])
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "tool", "user", "tool", "user", "assistant"]
    assert chat[-1]["content"] == "Il fait beau." and [c["id"] for c in chat[-1]["tool_calls"]] == ["c3"]
    # what a stream cannot take is refused, typed, naming the messages
    for bad in (ModelRequest(parts=[UserPromptPart(["look", ImageUrl("https://example.com/a.png")])]),):
        with pytest.raises(InvalidRequest) as err:
            message_items(bad)
        assert err.value.details()["field"] == "messages"


def test_settings_map_onto_generate_and_what_a_stream_cannot_honour_is_refused():
    max_tokens, settings = sampling({"max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3,
                                     "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {"65": -100},
                                     "stop_sequences": ["END"], "extra_body": {"min_p": 0.1},
                                     "timeout": 30, "parallel_tool_calls": True, "tool_choice": "auto"}, 256)
    assert max_tokens == 12
    assert settings == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "presence_penalty": 0.5,
                        "frequency_penalty": 0.25, "logit_bias": {65: -100.0}, "stop": ["END"], "min_p": 0.1}
    assert sampling(None, 256) == (256, {})
    for refused, field in (({"thinking": "high"}, "thinking"), ({"service_tier": "flex"}, "service_tier"),
                           ({"extra_headers": {"x": "y"}}, "extra_headers"),
                           ({"extra_body": {"top_a": 1}}, "extra_body"),
                           ({"parallel_tool_calls": False}, "parallel_tool_calls"),
                           ({"logit_bias": {"a": 1}}, "logit_bias"),
                           ({"openai_reasoning_effort": "low"}, "openai_reasoning_effort")):
        with pytest.raises(InvalidRequest) as err:
            sampling(refused, 256)
        assert err.value.details()["field"] == field, refused


async def test_outside_a_model_activity_a_request_is_refused_typed():
    model = MambaModel("tiny-mamba2")
    assert (model.model_name, model.system) == ("tiny-mamba2", PROVIDER_NAME)
    assert model.model_id == "mamba-stream:tiny-mamba2"  # Pydantic AI's provider:model
    with pytest.raises(ApplicationError) as err:
        await model.request([ModelRequest.user_text_prompt("hi")], None, ModelRequestParameters())
    assert err.value.type == "InvalidRequest" and err.value.non_retryable


def test_the_tool_choice_and_the_output_mode_say_what_a_reply_may_and_must_be():
    weather = ToolDefinition(name="weather", description="Weather.",
                             parameters_json_schema={"type": "object", "properties": {"city": {"type": "string"}}})
    sky = ToolDefinition(name="sky", description="Sky.", parameters_json_schema={"type": "object", "properties": {}})
    final = ToolDefinition(name="final_result", description="Out.", kind="output",
                           parameters_json_schema={"type": "object", "properties": {"days": {"type": "integer"}}})
    schema = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}

    def reply(settings: dict[str, Any] | None = None, **params: Any) -> tuple[list[str], Any, Any]:
        tools, must, output = _reply(ModelRequestParameters(function_tools=[weather, sky], **params), settings)
        return [t["function"]["name"] for t in tools], must, output

    assert reply() == (["weather", "sky"], None, None)  # free text, or a call of either
    assert reply({"tool_choice": "none"}) == ([], None, None)
    assert reply({"tool_choice": "required"}) == (["weather", "sky"], ["weather", "sky"], None)
    assert reply({"tool_choice": ["sky"]}) == (["weather", "sky"], ["sky"], None)
    assert reply({"tool_choice": ToolOrOutput(function_tools=["sky"])}) == (["sky"], None, None)
    # tool output: the reply is a call, of a function tool or the output's
    assert reply(output_mode="tool", output_tools=[final], allow_text_output=False) == (
        ["weather", "sky", "final_result"], ["weather", "sky", "final_result"], None)
    assert reply({"tool_choice": "none"}, output_mode="tool", output_tools=[final], allow_text_output=False) == (
        ["final_result"], ["final_result"], None)
    # native (and prompted) output: the text is the schema's JSON, unless a tool is called
    native = {"output_mode": "native", "output_object": OutputObjectDefinition(schema)}
    assert reply(**native) == (["weather", "sky"], None, schema)
    assert reply({"tool_choice": "none"}, **native) == ([], [], schema)
    for settings, params, field in (({"tool_choice": "required"}, {"function_tools": []}, "tool_choice"),
                                    (None, {"output_mode": "image", "allow_image_output": True}, "output_mode"),
                                    (None, {"native_tools": [WebSearchTool()]}, "native_tools")):
        with pytest.raises(InvalidRequest) as refused:
            _reply(ModelRequestParameters(**params), settings)
        assert refused.value.details()["field"] == field


async def test_a_stream_worker_sigkilled_mid_request_changes_no_bit_of_the_conversation(
        temporal_env, tmp_path, monkeypatch):
    """The worker holding the conversation's stream dies (SIGKILL) with the second question's
    feed (chunk 5) committed and not yet recorded; a rescuer takes the stream over, the model
    activity's chunk calls are answered from the stream's records, and the conversation ends on
    the messages and the checksum of an uninterrupted run of the same agent (a fixed seed)."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits, doomed_worker(stack, tmp_path, "recorded", "5", "local") as proc:
        client, queue = await _agent_worker(stack, monkeypatch)
        start = conversation_start(stack.client, "alice")
        run = await stack.client.start_workflow(WeatherChat.run, args=[QUESTIONS, None, 11], task_queue=queue,
                                                **start)
        await sigkilled(proc)
        await stack.worker()  # the rescuer: workflows and activities, as every worker is
        crashed = ModelMessagesTypeAdapter.validate_json(await run.result())
        clean, again = await _converse(stack, queue, QUESTIONS, seed=11)

        def replies(messages: list[ModelMessage]) -> list[Any]:
            return [[(type(p).__name__, getattr(p, "content", None), getattr(p, "args", None)) for p in m.parts]
                    for m in messages if isinstance(m, ModelResponse)]
        assert replies(crashed) == replies(clean)  # the same replies
        a, b = _handles(stack, start["id"], crashed)[-1], _handles(stack, again["id"], clean)[-1]
        assert a.seq == b.seq == 4 * len(QUESTIONS) and not a.forked
        ra, rb = await stack.streams.receipt(a.stream_id), await stack.streams.receipt(b.stream_id)
        assert (ra.position, ra.checksum) == (rb.position, rb.checksum)
        assert await _replays(client, queue) == 2  # the crashed run and the clean one

"""The Agent Data Protocol's standardized trajectory (schema 1.5.0), as pydantic models.

ADP publishes no package: its models live in github.com/neulab/agent-data-protocol under
schema/ (trajectory.py and version.py at commit 0dc087521a121c096a27a010f4007c9b855a1474,
action/ and observation/ as of that schema). These are those models for the classes the
export writes, written down from that source with the same fields, defaults and validators
(the repo's `exclude_if` serialization hints left out: only validation is needed here).
"""

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMA_VERSION = "1.5.0"
SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION, "1.4.0", "1.3.0", "1.2.0", "1.1.0", "1.0.0")


class Action(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reward: float | None = None


class ApiAction(Action):
    class_: str = Field("api_action")
    function: str
    kwargs: dict[str, Any]
    description: str | None = None

    @field_validator("class_")
    @classmethod
    def validate_class(cls, v):
        if v != "api_action":
            raise ValueError(f"class_ must be 'api_action', got '{v}'")
        return v


class MessageAction(Action):
    class_: str = Field("message_action")
    content: str
    description: str | None = None

    @field_validator("class_")
    @classmethod
    def validate_class(cls, v):
        if v != "message_action":
            raise ValueError(f"class_ must be 'message_action', got '{v}'")
        return v


class Observation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool_call_id: str | None = None
    reward: float | None = None


class TextObservation(Observation):
    class_: str = Field("text_observation")
    content: str
    name: str | None = None
    source: Literal["user", "agent", "environment"]

    @field_validator("class_")
    @classmethod
    def validate_class(cls, v):
        if v != "text_observation":
            raise ValueError(f"class_ must be 'text_observation', got '{v}'")
        return v

    @model_validator(mode="after")
    def validate_tool_result_source(self):
        if self.tool_call_id is not None and self.source == "user":
            raise ValueError(
                "TextObservation with tool_call_id represents a tool result and "
                "must not use source='user'"
            )
        return self


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: str = Field(default=SCHEMA_VERSION)
    id: str
    content: list[Union[ApiAction, MessageAction, TextObservation]]
    available_custom_tools: list[str] | None = None
    available_code_languages: list[str] | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    @field_validator("schema_version")
    @classmethod
    def validate_schema_version(cls, value):
        if value not in SUPPORTED_SCHEMA_VERSIONS:
            raise ValueError(f"Unsupported schema_version {value!r}")
        return value

    @model_validator(mode="after")
    def validate_tool_call_links(self):
        action_indices: dict[str, int] = {}
        matched: dict[str, int] = {}
        for index, item in enumerate(self.content):
            tool_call_id = getattr(item, "tool_call_id", None)
            next_item = self.content[index + 1] if index + 1 < len(self.content) else None
            if (
                isinstance(item, ApiAction)
                and isinstance(next_item, Observation)
                and tool_call_id is None
            ):
                raise ValueError(
                    f"Tool action at content index {index} is followed by an "
                    "Observation result but does not include tool_call_id"
                )
            if tool_call_id is None:
                continue
            if isinstance(item, MessageAction):
                raise ValueError(
                    f"MessageAction at content index {index} has tool_call_id, which "
                    "is not allowed because MessageAction is not a tool call"
                )
            if isinstance(item, ApiAction):
                if tool_call_id in action_indices:
                    raise ValueError(f"Duplicate Action.tool_call_id {tool_call_id!r}")
                action_indices[tool_call_id] = index
                continue
            if isinstance(item, Observation):
                if tool_call_id not in action_indices:
                    raise ValueError(
                        f"Observation.tool_call_id {tool_call_id!r} at content index {index} "
                        "does not match any preceding Action.tool_call_id"
                    )
                if tool_call_id in matched:
                    raise ValueError(f"Duplicate observation result for tool_call_id {tool_call_id!r}")
                matched[tool_call_id] = index
        for tool_call_id in action_indices:
            if tool_call_id not in matched:
                raise ValueError(
                    f"Action.tool_call_id {tool_call_id!r} does not have a matching "
                    "Observation.tool_call_id"
                )
        return self

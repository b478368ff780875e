-- Argo CD health check for trajectories.dev/TrajectoryRun (Lua 5.1, as Argo CD's gopher-lua runs it).
-- Install it under resource.customizations.health.trajectories.dev_TrajectoryRun in argocd-cm. It
-- needs no standard library beyond base and table: a script from argocd-cm runs without string and
-- math unless resource.customizations.useOpenLibs.trajectories.dev_TrajectoryRun is "true".
-- The source is examples/gitops/argocd/resource_customizations/trajectories.dev/TrajectoryRun/health.lua
-- (upstream's layout, with health_test.yaml and testdata/); examples/gitops/argocd/health.lua and
-- argocd-cm.yaml hold this exact text (tests/tests/gitops.rs fails when they differ).
--
--   Progressing  not yet reconciled, a spec change not yet acted on, or Planning/Running/Merging
--   Suspended    spec.suspend is set (the Suspended condition): pods stopped, done batches stay done
--   Healthy      Succeeded: the output is complete
--   Degraded     Failed: the Failed condition's reason and message say why
local hs = {}

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile the run"
  return hs
end

local conditions = {}
if status.conditions ~= nil then
  for _, condition in ipairs(status.conditions) do
    conditions[condition.type] = condition
  end
end

local function holds(type)
  return conditions[type] ~= nil and conditions[type].status == "True"
end

local function said(type, default)
  local condition = conditions[type]
  if condition ~= nil and condition.message ~= nil and condition.message ~= "" then
    if condition.reason ~= nil and condition.reason ~= "" then
      return condition.reason .. ": " .. condition.message
    end
    return condition.message
  end
  return default
end

-- A status written for an older spec says nothing yet about the current one.
local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to act on the latest spec (generation " .. generation .. ")"
  return hs
end

if status.phase == "Failed" or holds("Failed") then
  hs.status = "Degraded"
  hs.message = said("Failed", "The run failed")
  return hs
end

if status.phase == "Succeeded" or holds("Succeeded") then
  hs.status = "Healthy"
  local message = "Succeeded"
  if status.output ~= nil and status.output.trajectories ~= nil then
    message = message .. ": " .. status.output.trajectories .. " trajectories"
  end
  hs.message = message
  return hs
end

local progress = ""
if status.progress ~= nil then
  progress = " (" .. status.progress .. " batches)"
end

if holds("Suspended") then
  hs.status = "Suspended"
  hs.message = "Suspended in phase " .. status.phase .. progress
  return hs
end

hs.status = "Progressing"
hs.message = status.phase .. progress
return hs

-- Argo CD health of a fleetpilot InferenceService (resource.customizations.health.fleetpilot.dev_InferenceService).
--
-- Reads the conditions the operator writes, in this order:
--   no status yet, or a status older than the spec (observedGeneration) -> Progressing
--   Stalled=True      (a refused plan, a rollout past its deadline, pods refused) -> Degraded
--   Reconciling=True  (a rollout under way)                                        -> Progressing
--   Ready=True        (every role and the router rolled out and ready)             -> Healthy
--   Degraded=True     (crash loops, image pulls, unschedulable pods, ...)          -> Degraded
--   anything else                                                                 -> Progressing
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, item in ipairs(obj.status.conditions) do
    if item.type == kind then
      return item
    end
  end
  return nil
end

if obj.status == nil or obj.status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the fleetpilot operator"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to see generation " .. obj.metadata.generation
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.reason .. ": " .. (stalled.message or "")
  return hs
end
local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = reconciling.message or reconciling.reason
  return hs
end
local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or ready.reason
  return hs
end
local degraded = condition("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = degraded.reason .. ": " .. (degraded.message or "")
  return hs
end
hs.status = "Progressing"
if ready ~= nil then
  hs.message = ready.message or ready.reason
else
  hs.message = "Waiting for the fleetpilot operator"
end
return hs

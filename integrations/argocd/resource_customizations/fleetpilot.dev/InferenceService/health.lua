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

-- A condition's words: "Reason: message" where asked and both are there, else whichever is.
-- reason and message are both optional in a condition a hand or another controller wrote
-- (metav1.Condition requires them; kstatus-style conditions do not), and Lua refuses to
-- concatenate nil: every part is checked first.
local function present(text)
  return text ~= nil and text ~= ""
end

local function describe(item, with_reason)
  if with_reason and present(item.reason) and present(item.message) then
    return item.reason .. ": " .. item.message
  end
  if present(item.message) then
    return item.message
  end
  if present(item.reason) then
    return item.reason
  end
  return item.type .. " is " .. tostring(item.status)
end

local function when_true(kind, status, with_reason)
  local item = condition(kind)
  if item == nil or item.status ~= "True" then
    return nil
  end
  return {status = status, message = describe(item, with_reason)}
end

local verdict = when_true("Stalled", "Degraded", true)
  or when_true("Reconciling", "Progressing", false)
  or when_true("Ready", "Healthy", false)
  or when_true("Degraded", "Degraded", true)
if verdict ~= nil then
  return verdict
end
local ready = condition("Ready")
hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready, false)
else
  hs.message = "Waiting for the fleetpilot operator"
end
return hs
